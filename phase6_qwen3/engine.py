"""The engine: requests in, tokens out, one scheduler step at a time.

Problem: phase 3 could only run a fixed batch from start to finish. A server receives requests
at any time and must return each one as soon as it is done.
Idea (vLLM's LLMEngine): `add_request` queues a sequence; every `step()` asks the scheduler what to
run, runs it through the model runner, appends the sampled tokens, and retires sequences that hit
EOS, a stop token or max_tokens, freeing their KV slots for the next waiting request at once.
`LLM.generate` is the offline loop around it: add everything, step until done.

One bad request never breaks the engine: `SamplingParams` and `EngineConfig` are valid once built,
`add_request` checks a prompt before queuing it, and `LLM.generate` is all or nothing (if anything
raises, none of its requests stays queued or running). If a step itself raises (a model error),
the requests it ran are aborted and their KV freed before the error propagates, so the next step
starts clean instead of failing the same way forever.

Invariant: after every step, `scheduler.check_invariants()` holds (tests call it each step).

Phase 5: the engine's `BlockManager` is the paged one; blocks that a step filled with computed
tokens are registered in the prefix cache, and blocks the scheduler swapped are copied first.

Phase 6: real text. `LLM("path/or/hub-id")` (or `LLM()`, the embedded SmolLM2) loads a checkpoint
and its tokenizer; every request streams its tokens through an incremental detokenizer, stops at
any of the checkpoint's EOS ids or at a stop string (the text is cut before it), and
`LLM.chat` renders conversations with the checkpoint's chat template. Streamed text only grows:
a step's output holds back the last len(stop) - 1 characters that could still begin a stop
string (vLLM's rule) and any unfinished multi-byte character, so text already shown never changes.
A hybrid model (Qwen3.5) runs with prefix caching off: a cached block would give back keys and
values, but not the DeltaNet state after them, which only a full recompute rebuilds.
"""

import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from .block_manager import BlockManager
from .config import EngineConfig
from .default_model import default_model_dir
from .loader import load_model, resolve_device, resolve_dtype
from .model import Qwen3ForCausalLM
from .model_runner import ModelRunner
from .qwen3_5 import Qwen3_5ForCausalLM, is_hybrid
from .sampling import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import FinishReason, Sequence
from .tokenizer import IncrementalDetokenizer, Tokenizer, check_conversations, find_stop_string
from .trace import StepTrace

Prompt = str | list[int]  # text, or token ids
Message = dict[str, Any]  # {"role": "user", "content": "..."}

logger = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort"; None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class Request:
    seq: Sequence
    prompt: str | None  # the text the caller gave, if it gave text
    detokenizer: IncrementalDetokenizer  # its output_text is the request's text so far


def check_prompt(name: str, prompt: object) -> None:
    """Raises TypeError unless `prompt` is text or a list of token ids (bytes are neither)."""
    if not isinstance(prompt, str | list):
        raise TypeError(f"{name} must be a str or a list of token ids, got {type(prompt).__name__}")


def check_optional(name: str, value: object, cls: type) -> None:
    """Raises TypeError unless `value` is None or a `cls` (an argument in the wrong place, say)."""
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__} or None, got {type(value).__name__}")


class LLMEngine:
    def __init__(
        self,
        model: Qwen3ForCausalLM | Qwen3_5ForCausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        trace: StepTrace | None = None,
    ):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a Tokenizer, got {type(tokenizer).__name__}")
        check_optional("config", config, EngineConfig)
        check_optional("trace", trace, StepTrace)
        self.config = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids
        self.trace = trace
        prefix_caching = self.config.enable_prefix_caching
        if prefix_caching and is_hybrid(model.config):
            logger.warning(
                "prefix caching is off for this hybrid model: its DeltaNet state cannot be "
                "restored from cached KV blocks"
            )
            prefix_caching = False
        self.block_manager = BlockManager(
            self.config.num_kv_blocks, self.config.block_size, prefix_caching,
            self.config.num_cpu_kv_blocks,
        )  # fmt: skip
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.runner = ModelRunner(model, self.config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Queues one request; raises (changing nothing) if it is malformed or can never run."""
        check_prompt("prompt", prompt)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_optional("request_id", request_id, str)
        prompt_ids = self._tokenize(prompt)
        max_len = len(prompt_ids) + params.max_tokens
        if max_len > self.model.config.max_position_embeddings:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context ({self.model.config.max_position_embeddings})"
            )
        if max_len > self.config.num_kv_slots:
            raise ValueError(
                f"prompt + max_tokens ({max_len}) can never fit in the KV cache "
                f"({self.config.num_kv_slots} slots)"
            )
        if not self.config.enable_chunked_prefill and max_len > self.config.max_num_batched_tokens:
            raise ValueError(
                f"without chunked prefill, prompt + max_tokens ({max_len}) must fit in one step's "
                f"token budget (max_num_batched_tokens={self.config.max_num_batched_tokens})"
            )
        seq_id = next(self._seq_ids)
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(seq_id, request_id, prompt_ids, params)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        self.requests[request_id] = Request(seq, prompt if isinstance(prompt, str) else None,
                                            detokenizer)  # fmt: skip
        self.scheduler.add(seq)
        return request_id

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        vocab = self.model.config.vocab_size
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {token!r}")
        return list(prompt)

    def abort_request(self, request_id: str) -> None:
        """Stops a request and frees its KV slots; unknown or finished ids are ignored."""
        if request_id not in self.requests:
            return
        seq = self.requests.pop(request_id).seq
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.runner.release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns the requests that got a token or finished.

        If the step raises, the requests it ran are aborted (their KV freed) and the error
        propagates: what they computed is unknown, and a failure that depends on the request
        would otherwise repeat at every later step.
        """
        start = time.perf_counter()
        out = self.scheduler.schedule()
        try:
            return self._run(out, start)
        except BaseException:
            for seq, _ in out.scheduled:
                self.abort_request(seq.request_id)
            raise

    def _run(self, out: SchedulerOutput, start: float) -> list[RequestOutput]:
        for seq in out.preempted:
            self.runner.preempt(seq)
        self.runner.swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
        # A step may run nothing (every running sequence was preempted); the trace still records
        # it.
        tokens = self.runner.run(out.scheduled) if out.scheduled else []
        updated, finished = [], []
        for (seq, num_new), token in zip(out.scheduled, tokens, strict=True):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)
            if token is None:
                continue
            seq.token_ids.append(token)
            updated.append(seq)
            reason = self._finish_reason(seq, token)
            if reason is not FinishReason.STOP:  # a stop token's own text is never shown
                reason = self._detokenize(seq, token) or reason  # the last token has text too
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.runner.release(seq)
                finished.append(seq)
        if self.trace is not None:
            self.trace.record(start, time.perf_counter(), out, finished, self.scheduler)
        outputs = [self._output(seq) for seq in updated]
        for seq in finished:
            del self.requests[seq.request_id]  # delivered: the engine forgets it
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (
            token in self.eos_token_ids and not params.ignore_eos
        ):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _detokenize(self, seq: Sequence, token: int) -> FinishReason | None:
        """Extends the request's text; a stop string ends the request, cut before the stop."""
        detokenizer = self.requests[seq.request_id].detokenizer
        delta = detokenizer.add_tokens([token])
        match = find_stop_string(detokenizer.output_text, seq.params.stop, len(delta))
        if match is None:
            return None
        detokenizer.output_text = detokenizer.output_text[: match.index]
        return FinishReason.STOP

    def _output(self, seq: Sequence) -> RequestOutput:
        request = self.requests[seq.request_id]
        if seq.is_finished and seq.finish_reason is not FinishReason.STOP:
            request.detokenizer.flush()  # a character split at max_tokens still shows up
        reason = seq.finish_reason.value if seq.finish_reason else None
        text = request.detokenizer.output_text
        if not seq.is_finished:  # the tail that may still turn out to start a stop string waits
            text = text[: len(text) - stop_hold_back(seq.params)]
        completion = CompletionOutput(0, text, seq.output_token_ids, reason)
        return RequestOutput(
            seq.request_id, request.prompt, seq.prompt_token_ids, [completion], seq.is_finished
        )


def stop_hold_back(params: SamplingParams) -> int:
    """Characters a running request's text keeps back: a stop string that ends in the next token
    may start up to len(stop) - 1 characters before the end of the text so far (vLLM's rule)."""
    return max((len(stop) - 1 for stop in params.stop), default=0)


class LLM:
    """Offline batch inference: `LLM("Qwen/Qwen3-0.6B").generate(prompts, params)`, vLLM's shape.

    `model`: a local Hugging Face directory or a hub id; None means the embedded SmolLM2.
    `dtype`: "auto" (bf16 on a bf16-capable GPU, else fp32), or "float32"/"bfloat16"/"float16".
    Every option is checked before the slow load.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        trace: StepTrace | None = None,
        **engine_kwargs,
    ):
        config = EngineConfig(**engine_kwargs)
        if model is not None and not isinstance(model, str | os.PathLike):
            raise TypeError(f"model must be a str, a path or None, got {type(model).__name__}")
        check_optional("trace", trace, StepTrace)
        device = resolve_device(device)
        resolve_dtype(dtype, device)  # raises on an unknown dtype
        loaded = load_model(default_model_dir() if model is None else model, dtype, device)
        tokenizer = Tokenizer.from_dir(loaded.model_dir)
        self.engine = LLMEngine(loaded.model, tokenizer, config, trace)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation or a list of them, rendered with the chat template."""
        conversations = check_conversations(messages)
        check_optional("chat_template_kwargs", chat_template_kwargs, dict)
        tokenizer = self.engine.tokenizer
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    c, add_generation_prompt, **(chat_template_kwargs or {})
                ),
                add_special_tokens=False,  # the rendered template already holds them
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of `prompts`.

        All or nothing: if anything raises (a bad prompt, a model error, Ctrl-C), every request
        of this call is aborted before the error propagates, so none runs later by surprise.
        """
        prompts, params = check_batch(prompts, sampling_params)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(p, sp))
            done: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for i in ids:
                self.engine.abort_request(i)
            raise
        return [done[i] for i in ids]


def check_batch(
    prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
) -> tuple[list[Prompt], list[SamplingParams]]:
    """`generate`'s arguments as one list of prompts and one of params, each checked by index.

    A bare string is one prompt (as in vLLM); bytes are not text and are refused.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, list | tuple):
        raise TypeError(f"prompts must be a str or a list of prompts, got {type(prompts).__name__}")
    for i, prompt in enumerate(prompts):
        check_prompt(f"prompts[{i}]", prompt)
    params = SamplingParams() if sampling_params is None else sampling_params
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if not isinstance(params, list | tuple):
        kind = type(params).__name__
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {kind}")
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    for i, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            raise TypeError(
                f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}"
            )
    return list(prompts), list(params)
