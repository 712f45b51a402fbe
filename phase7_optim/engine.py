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

Phase 7: the engine's own per-step work must stay small next to a GPU step of a few
milliseconds. Text is what costs: detokenizing every token of every request each step is tens of
microseconds a request. So a request's text is caught up only when someone reads it: every step
for a request with stop strings (they are searched in the text), otherwise when an output is
built. `LLM.generate` asks for final outputs only (`RequestOutputKind.FINAL_ONLY`, vLLM's name),
so a request without stop strings is detokenized once, when it finishes. The KV cache is sized
when the engine starts, from the device's memory (kv_cache_config.py), and its capacity logged.

Overlap scheduling (`async_scheduling`, vLLM's; SGLang's overlap scheduler): the host's share of
a step (schedule, prepare, launch, then read the tokens, append them, check stops) leaves the
device idle unless it runs while the device works on the step before. So `step()` schedules and
launches step N+1 first, and only then reads step N's tokens: the host's work hides behind the
device's. Step N+1 is scheduled before anyone knows what step N sampled: each token being
sampled is a placeholder (`Sequence.num_output_placeholders`), decoded in step N+1 straight from
the device (model_runner.py), and the host learns it a step later. The one-step-late rule: a
request that reaches max_tokens is never scheduled past its last token (its length is known in
advance), but a stop token or stop string is seen only after step N+1 was launched, possibly
with the stopped request in it; that step's token for it is dropped and never reaches an output,
and the request's blocks are freed once that step is done, never while it may still write them.
(Preemption is the one exception: the scheduler frees a victim's blocks while step N, which
wrote them, may still run; their next writer is a step launched later, and the device runs steps
in launch order.) Blocks enter the prefix cache once the step computing them is launched, for
known tokens only: a step that reads them is launched later. A seeded request's extra draw comes
after its last real one, so its tokens are those of the engine without overlap. With
`async_scheduling=False` each step's tokens are read right after its launch: the same code, with
nothing in flight between steps.

A hybrid model (Qwen3.5) runs with prefix caching off: a cached block would give back keys and
values, but not the DeltaNet state after them, which only a full recompute rebuilds.
"""

import atexit
import enum
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from .block_manager import BlockManager
from .config import EngineConfig, engine_config
from .default_model import default_model_dir
from .distributed import TensorParallel
from .kv_cache_config import determine_kv_cache_config, log_kv_cache, model_len
from .loader import load_model, read_model_config, resolve_device, resolve_dtype, resolve_model_dir
from .model import Qwen3ForCausalLM
from .model_runner import ModelRunner, SampledTokens
from .qwen3_5 import Qwen3_5ForCausalLM, is_hybrid
from .sampling import SEED_LIMIT, SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import FinishReason, Sequence
from .tokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    Tokenizer,
    check_conversations,
    find_stop_string,
)
from .trace import StepTrace
from .worker import start_workers

logger = logging.getLogger(__name__)

Prompt = str | list[int]  # text, or token ids
Message = dict[str, Any]  # {"role": "user", "content": "..."}


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


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # an output every step the request gets a token (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes (offline generate)


@dataclass
class Request:
    seq: Sequence
    prompt: str | None  # the text the caller gave, if it gave text
    detokenizer: IncrementalDetokenizer  # its output_text is the text of the tokens fed so far
    output_kind: RequestOutputKind
    num_detokenized: int = 0  # output tokens fed to the detokenizer
    cut_by_stop_string: bool = False  # its text ends where a stop string began


class InFlightStep:
    """A step launched on the device whose tokens the host has not read yet."""

    def __init__(self, scheduled: list[tuple[Sequence, int]], sampled: SampledTokens):
        self.scheduled = scheduled
        self.sampled = sampled
        self.seq_ids = {seq.seq_id for seq, _ in scheduled}


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
        device = next(model.parameters()).device
        self.config = (config or EngineConfig()).for_device(device.type)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids
        self.trace = trace
        # Sized from the device's memory (kv_cache_config.py); never written into the config.
        self.kv_cache_config = determine_kv_cache_config(model, self.config)
        log_kv_cache(self.kv_cache_config, device.type)
        prefix_caching = self.config.enable_prefix_caching
        if prefix_caching and is_hybrid(model.config):
            logger.warning(
                "prefix caching is off for this hybrid model: its DeltaNet state cannot be "
                "restored from cached KV blocks"
            )
            prefix_caching = False
        self.block_manager = BlockManager(
            self.kv_cache_config.num_blocks, self.config.block_size, prefix_caching,
            self.config.num_cpu_kv_blocks,
        )  # fmt: skip
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.runner = ModelRunner(model, self.config, self.block_manager, self.kv_cache_config)
        if self.runner.state_pool is not None:
            pool = self.runner.state_pool
            logger.info(
                "state pool: %d slots, %.2f GiB (%.1f MiB a sequence)", pool.num_slots,
                pool.memory_bytes / 2**30, pool.memory_bytes / pool.num_slots / 2**20,
            )  # fmt: skip
        self.in_flight: InFlightStep | None = None  # async scheduling: the step the device runs
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> str:
        """Queues one request; raises (changing nothing) if it is malformed or can never run."""
        check_prompt("prompt", prompt)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_optional("request_id", request_id, str)
        prompt_ids = self._tokenize(prompt)
        max_len = len(prompt_ids) + params.max_tokens
        if self.config.max_model_len is not None and max_len > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.config.max_model_len})"
            )
        if max_len > self.model.config.max_position_embeddings:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context ({self.model.config.max_position_embeddings})"
            )
        if max_len > self.kv_cache_config.num_tokens:
            raise ValueError(
                f"prompt + max_tokens ({max_len}) can never fit in the KV cache "
                f"({self.kv_cache_config.num_tokens} slots)"
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
                                            detokenizer, output_kind)  # fmt: skip
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
        in_flight = self.in_flight is not None and seq.seq_id in self.in_flight.seq_ids
        self.scheduler.finish(seq, FinishReason.ABORT, in_flight)
        self.runner.release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns the requests that got a token or finished. With
        async scheduling the tokens returned are those of the step launched by the call before.

        If the step raises, the requests it ran are aborted (their KV freed) and the error
        propagates: what they computed is unknown, and a failure that depends on the request
        would otherwise repeat at every later step.
        """
        start = time.perf_counter()
        out = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        try:
            return self._run(out, previous, start)
        except BaseException:
            self.in_flight = None  # nothing is read from it any more: its requests go now
            self.scheduler.free_finished_in_flight()
            for seq, _ in out.scheduled + (previous.scheduled if previous else []):
                self.abort_request(seq.request_id)
            raise

    def _run(
        self, out: SchedulerOutput, previous: InFlightStep | None, start: float
    ) -> list[RequestOutput]:
        for seq in out.preempted:
            self.runner.preempt(seq)
        self.runner.swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
        # A step may run nothing (every running sequence was preempted, or is about to finish);
        # the trace still records it.
        launched = None
        if out.scheduled:
            sampled = self.runner.launch(out.scheduled, previous.sampled if previous else None)
            launched = InFlightStep(out.scheduled, sampled)
        # async: the device runs `launched` while the host reads and applies `previous`
        updated, finished = self._process(previous, launched) if previous else ([], [])
        if launched is not None:
            self._update_after_launch(launched)
            if self.config.async_scheduling:
                self.in_flight = launched
            else:
                more_updated, more_finished = self._process(launched, None)
                updated += more_updated
                finished += more_finished
        if self.trace is not None:
            self.trace.record(start, time.perf_counter(), out, finished, self.scheduler)
        outputs = [
            self._output(seq)
            for seq in updated
            if seq.is_finished
            or self.requests[seq.request_id].output_kind is RequestOutputKind.CUMULATIVE
        ]
        for seq in finished:
            del self.requests[seq.request_id]  # delivered: the engine forgets it
        return outputs

    def _update_after_launch(self, step: InFlightStep) -> None:
        """The launched step's tokens count as computed, and each token it samples as a
        placeholder, before anyone reads them: the next step is scheduled on them, and the
        blocks they fill enter the prefix cache (those of known tokens: block_manager.py)."""
        for seq, num_new in step.scheduled:
            if seq.is_finished:
                continue  # stopped one step late: what this step computes for it is dropped
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens == seq.num_tokens + seq.num_output_placeholders:
                seq.num_output_placeholders += 1  # caught up: this step samples its next token
            # a later step that reads these blocks runs after this one on the device
            self.block_manager.cache_full_blocks(seq)

    def _process(
        self, step: InFlightStep, next_step: InFlightStep | None
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Reads a launched step's tokens (waiting for the device if need be) and applies them:
        tokens are appended, finished sequences retire. `next_step`, launched after `step` and
        still running, keeps its finished sequences' blocks until it is done.
        -> (sequences that got a token, sequences that finished)."""
        tokens = iter(step.sampled.tolist())  # `step` is done once its tokens are here
        self.scheduler.free_finished_in_flight()  # finished while `step` ran, which wrote them
        updated, finished = [], []
        for seq, _ in step.scheduled:
            token = next(tokens) if seq.seq_id in step.sampled.row_of else None
            if seq.is_finished:
                continue  # aborted, or stopped a step late: its token never reaches an output
            if token is None:
                continue
            seq.num_output_placeholders -= 1
            seq.token_ids.append(token)
            updated.append(seq)
            reason = self._finish_reason(seq, token)
            # a stop token's own text is never shown; only stop strings need the text each step
            if reason is not FinishReason.STOP and seq.params.stop:
                reason = self._detokenize(seq) or reason  # the last token has text too
            if reason is not None:
                in_flight = next_step is not None and seq.seq_id in next_step.seq_ids
                self.scheduler.finish(seq, reason, in_flight)
                self.runner.release(seq)
                finished.append(seq)
        return updated, finished

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (
            token in self.eos_token_ids and not params.ignore_eos
        ):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _catch_up_text(self, request: Request, num_tokens: int) -> str:
        """Feeds the detokenizer the output tokens up to `num_tokens`; returns the new text."""
        new = request.seq.token_ids[
            request.seq.num_prompt_tokens + request.num_detokenized :
            request.seq.num_prompt_tokens + num_tokens
        ]  # fmt: skip
        if not new:
            return ""
        request.num_detokenized = num_tokens
        return request.detokenizer.add_tokens(new)

    def _detokenize(self, seq: Sequence) -> FinishReason | None:
        """Extends the request's text; a stop string ends the request, cut before the stop."""
        request = self.requests[seq.request_id]
        delta = self._catch_up_text(request, seq.num_output_tokens)
        detokenizer = request.detokenizer
        match = find_stop_string(detokenizer.output_text, seq.params.stop, len(delta))
        if match is None:
            return None
        detokenizer.output_text = detokenizer.output_text[: match.index]
        request.cut_by_stop_string = True
        return FinishReason.STOP

    def _output(self, seq: Sequence) -> RequestOutput:
        request = self.requests[seq.request_id]
        # every token has text but a stop token (a stop string's request is already caught up)
        stopped = seq.finish_reason is FinishReason.STOP
        self._catch_up_text(request, seq.num_output_tokens - stopped)
        if seq.is_finished and not request.cut_by_stop_string:
            # what the detokenizer held back (a text decoded once, at the end, is all held back
            # if its last character is split): at max_tokens it shows, a split character as
            # U+FFFD; before a stop token only what it completes (the character never finished)
            # (no delta ends in U+FFFD: only the flushed tail can)
            detokenizer = request.detokenizer
            detokenizer.flush()
            if stopped:
                detokenizer.output_text = detokenizer.output_text.rstrip(REPLACEMENT_CHAR)
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


# `LLM`'s own keyword arguments; every other one is an engine argument (config.engine_config)
LLM_ARGUMENTS = ("model", "dtype", "device", "trace", "seed")


class LLM:
    """Offline batch inference: `LLM("Qwen/Qwen3-0.6B").generate(prompts, params)`, vLLM's shape.

    `model`: a local Hugging Face directory or a hub id; None means the embedded SmolLM2.
    `dtype`: "auto" (bf16 on a bf16-capable GPU, else fp32), or "float32"/"bfloat16"/"float16".
    `seed`: seeds torch's random state, which requests without a seed of their own draw from
    (vLLM's engine seed); None leaves it as it is.
    `engine_kwargs`: vLLM's engine arguments (max_model_len, max_num_seqs, gpu_memory_utilization,
    tensor_parallel_size, enforce_eager, ...): `EngineConfig`'s fields, and vLLM's other names
    for them (config.py's `engine_config`); an unknown one is a TypeError that lists them.
    Every option is checked before the slow load.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        trace: StepTrace | None = None,
        seed: int | None = None,
        **engine_kwargs,
    ):
        # bad settings fail before the slow load
        config = engine_config("LLM", engine_kwargs, LLM_ARGUMENTS)
        if model is not None and not isinstance(model, str | os.PathLike):
            raise TypeError(f"model must be a str, a path or None, got {type(model).__name__}")
        check_optional("trace", trace, StepTrace)
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT
        ):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, got {seed!r}")
        device = resolve_device(device)
        resolve_dtype(dtype, device)  # raises on an unknown dtype
        config = config.for_device(device.type)  # every rank gets the same batch sizes
        model_dir = resolve_model_dir(default_model_dir() if model is None else model)
        # Tensor parallelism (worker.py): ranks 1.. load their shards in their own processes
        # and follow this one's steps; with one rank there is no process group at all.
        model_config = read_model_config(model_dir)
        model_len(model_config, config)  # raises if max_model_len exceeds the model's context
        tp = TensorParallel(0, config.tensor_parallel_size)
        if tp.size > 1 and is_hybrid(model_config):
            raise ValueError(
                "Qwen3.5 runs on one GPU here: tensor parallelism is not built for its DeltaNet "
                "layers (tensor_parallel_size must be 1)"
            )
        self.workers = None
        if tp.size > 1:
            self.workers = start_workers(model_dir, dtype, torch.device(device), config)
        loaded = load_model(model_dir, dtype, device, tp, config.load_format, config.kernels)
        tokenizer = Tokenizer.from_dir(loaded.model_dir)
        self.engine = LLMEngine(loaded.model, tokenizer, config, trace)
        if self.workers is not None:
            atexit.register(self.shutdown)
        if seed is not None:  # last: loading and profiling draw nothing a request would see
            torch.manual_seed(seed)

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers: CUDA graphs first, then the process group."""
        if self.workers is not None:
            atexit.unregister(self.shutdown)
            self.engine.runner.shutdown()
            self.workers.stop()

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
                ids.append(self.engine.add_request(p, sp, output_kind=RequestOutputKind.FINAL_ONLY))
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
