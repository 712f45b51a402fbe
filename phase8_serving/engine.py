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
and its tokenizer; requests stop at any of the checkpoint's EOS ids, and `LLM.chat` renders
conversations with the checkpoint's chat template.

Phase 7: the engine's own per-step work must stay small next to a GPU step of a few
milliseconds. The KV cache is sized when the engine starts, from the device's memory
(kv_cache_config.py), and its capacity logged.

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

Phase 8: text leaves the engine (vLLM v1's split). `LLMEngine` speaks token ids only: each step
returns a `TokenIdsOutput` per request that got a token (its new ids, their logprobs if asked,
the finish reason of a stop token, EOS or max_tokens), the engine core process's whole job
(engine_core.py). Text, stop strings and the hold-back of what a stop string might still remove
are the output processor's (output_processor.py), beside the HTTP server or, offline, inside
`LLM`, which is `LLMEngine` + `OutputProcessor` as vLLM v1's `LLMEngine` is `EngineCore` +
`OutputProcessor`: one rule for streamed and offline text. A stop string found there aborts the
request in the engine (at once, or once the step computing it on the device is done). `LLM.step`
gives each request's new text (`RequestOutputKind.DELTA`) or, for `LLM.generate`, one output when
it finishes (`FINAL_ONLY`); a request that no stop string can end and whose text nobody reads
before it finishes is detokenized once, at the end (detokenizing every token every step costs
microseconds a request). The engine also counts `num_preemptions` for the server's metrics, and
`num_steps` and `last_schedule` (the step's `SchedulerOutput`) let the dashboard show what the
last step ran. The engine core passes each client request's id as the `group_id` of all its
choices, so the scheduler shares the engine fairly between client requests, not sequences
(scheduler.py). `min_tokens` (vLLM's rule): before that many tokens, EOS and stop tokens cannot be
sampled (model_runner.py) nor end the request, and a stop string counts only if it ends in text
of a later token. Token ids a request names (stop tokens, logit bias) must be in the vocabulary,
or `add_request` refuses it. None of this makes overlap scheduling wait for a step's tokens: the
penalties count a placeholder token on the device, min_tokens counts placeholders, and logprobs
are computed on the device beside the token they describe (model_runner.py).

A hybrid model (Qwen3.5) runs with prefix caching off: a cached block would give back keys and
values, but not the DeltaNet state after them, which only a full recompute rebuilds.
"""

import atexit
import copy
import enum
import functools
import itertools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

import torch
from tqdm.auto import tqdm

from .beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from .block_manager import BlockManager
from .config import EngineConfig, check_priority, engine_config
from .core_messages import EngineCoreOutput
from .default_model import default_model_dir
from .distributed import TensorParallel
from .kv_cache_config import determine_kv_cache_config, log_kv_cache, model_len
from .loader import load_model, read_model_config, resolve_device, resolve_dtype, resolve_model_dir
from .logprobs import TokenLogprobs
from .model import Qwen3ForCausalLM
from .model_runner import ModelRunner, SampledTokens
from .output_processor import (
    OutputProcessor,
    RequestOutputCollector,
    RequestState,
)
from .qwen3_5 import Qwen3_5ForCausalLM, is_hybrid
from .sampling_params import (
    PROMPT_LOGPROBS_NEED_ONE_RANK,
    SEED_LIMIT,
    SamplingParams,
    generation_defaults,
)
from .scheduler import Scheduler, SchedulerOutput
from .sequence import FinishReason, Sequence
from .streaming import OutputDelta
from .structured_output import GrammarCache, Vocabulary, check_byte_level
from .tokenizer import Tokenizer, check_conversations
from .trace import StepTrace
from .worker import start_workers

logger = logging.getLogger(__name__)


class TextPrompt(TypedDict):
    """vLLM's prompt as a dict: `{"prompt": "text"}`."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's prompt as a dict: `{"prompt_token_ids": [ids]}`."""

    prompt_token_ids: list[int]


Prompt = str | list[int] | TextPrompt | TokensPrompt  # text or token ids, bare or as a dict
Message = dict[str, Any]  # {"role": "user", "content": "..."}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    logprobs: list[TokenLogprobs] | None = None  # one per token id, if the request asked
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it
    # vLLM's: the sum of the logprobs of every token so far, if the request asked for logprobs
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (vLLM's)
    # vLLM's: one per prompt token (None for the first), if asked (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class TokenIdsOutput:
    """A request's output from one step: the ids it added and their logprobs, no text.
    One object, not a `RequestOutput` around a `CompletionOutput`: an engine core makes one per
    request per step, and two dataclasses took 15% of its time."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None  # one per new token id, if the request asked
    finish_reason: str | None  # "stop", "length"; None while running
    # with the first token, if the request asked: one per prompt token (the first has none)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class RequestOutputKind(enum.Enum):
    """What `LLM.step` returns for a request (vLLM's names)."""

    DELTA = "delta"  # an output every step the request gets text or a token: the new ones
    FINAL_ONLY = "final_only"  # one output, the whole completion, when it finishes (generate)


@dataclass
class Request:
    seq: Sequence
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # as scored, if asked


@dataclass
class LLMRequest:
    """A request as `LLM` follows it: the engine's, and its text in the output processor."""

    request: Request
    prompt: str | None  # the text the caller gave, if it gave text
    state: RequestState  # its own collector merges the deltas nobody has read yet
    output_kind: RequestOutputKind

    parent: "ParentRequest | None" = None  # the request of n > 1 it is choice `index` of
    index: int = 0
    cumulative_logprob: float = 0.0  # of the tokens output so far (if it asked for logprobs)

    @property
    def detokenized_at_end(self) -> bool:
        """Nobody reads its text before it finishes and no stop string can end it: its ids go
        to the output processor once, when it finishes."""
        return self.output_kind is RequestOutputKind.FINAL_ONLY and not self.state.stops


@dataclass
class ParentRequest:
    """A request for n > 1 completions (vLLM's `ParentRequest`): n engine requests in one group
    (the scheduler is fair across groups), one `RequestOutput` id; FINAL_ONLY gathers the n
    completions, in index order, into one output once the last one finishes."""

    request_id: str
    child_ids: list[str]
    num_unfinished: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)  # FINAL_ONLY's


class InFlightStep:
    """A step launched on the device whose tokens the host has not read yet."""

    def __init__(self, scheduled: list[tuple[Sequence, int]], sampled: SampledTokens):
        self.scheduled = scheduled
        self.sampled = sampled
        self.seq_ids = {seq.seq_id for seq, _ in scheduled}


def as_prompt(name: str, prompt: object) -> str | list[int]:
    """`prompt` as text or token ids: vLLM's dicts (`TextPrompt`, `TokensPrompt`) unwrapped.
    Raises TypeError for anything else (bytes are not text) and ValueError for a dict with other
    keys (vLLM's `multi_modal_data`, say: there is nothing here to take them)."""
    if isinstance(prompt, dict):
        keys = sorted(map(str, prompt))
        if keys not in (["prompt"], ["prompt_token_ids"]):
            raise ValueError(f"{name} as a dict takes one key, 'prompt' (text) or "
                             f"'prompt_token_ids' (token ids), got {keys}")  # fmt: skip
        key, kind = ("prompt", str) if "prompt" in keys else ("prompt_token_ids", list)
        prompt = prompt[key]
        if not isinstance(prompt, kind):
            raise TypeError(
                f"{name}[{key!r}] must be a {kind.__name__}, got {type(prompt).__name__}"
            )
    if not isinstance(prompt, str | list):
        kind = type(prompt).__name__
        raise TypeError(f"{name} must be a str, a list of token ids or a prompt dict, got {kind}")
    return prompt


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
        vocab = model.config.vocab_size  # a tokenizer's id past the LM head can never be sampled
        eos_ids = frozenset(t for t in self.eos_token_ids if t < vocab)
        # the vocabulary as bytes, for structured outputs: built by the first request with one
        grammars = GrammarCache(lambda: Vocabulary.from_tokenizer(tokenizer, vocab))
        self.runner = ModelRunner(
            model, self.config, self.block_manager, self.kv_cache_config, eos_ids, grammars
        )
        if self.runner.state_pool is not None:
            pool = self.runner.state_pool
            logger.info(
                "state pool: %d slots, %.2f GiB (%.1f MiB a sequence)", pool.num_slots,
                pool.memory_bytes / 2**30, pool.memory_bytes / pool.num_slots / 2**20,
            )  # fmt: skip
        self.in_flight: InFlightStep | None = None  # async scheduling: the step the device runs
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.num_preemptions = 0  # since start, for the server's metrics
        self.num_steps = 0  # since start, for the dashboard
        self.last_schedule = SchedulerOutput()  # what the last step ran, for the dashboard

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        group_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queues one request; raises (changing nothing) if it is malformed or can never run.
        `group_id`: the client request it is one choice of, shared by all of them (the scheduler
        is fair across groups, not sequences); None: a group of its own. `priority` (vLLM's):
        lower runs first, under scheduling_policy "priority"; 0 otherwise."""
        prompt = as_prompt("prompt", prompt)
        check_priority(priority, self.config.scheduling_policy)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_optional("request_id", request_id, str)
        check_optional("group_id", group_id, str)
        if params.n != 1:
            raise ValueError(
                f"the engine runs one completion a request, got n={params.n}: add n requests "
                "(LLM does, and the server, each seeded seed + i)"
            )
        params.check_token_ids(self.model.config.vocab_size)
        params.check_allowed_tokens(self.eos_token_ids)
        bad_words = params.bad_words_token_ids(self._encode_word)
        if params.structured_outputs is not None:
            check_byte_level(self.tokenizer)
        prompt_ids = self._tokenize(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:  # the prompt's last `keep` tokens (-1: as many as the context holds)
            keep = self.kv_cache_config.max_model_len if keep == -1 else keep
            prompt_ids = prompt_ids[-keep:]
        self.check_length(prompt_ids, params.max_tokens)
        seq_id = next(self._seq_ids)
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.prompt_logprobs is not None and self.model.tp.size > 1:
            raise ValueError(PROMPT_LOGPROBS_NEED_ONE_RANK)
        seq = Sequence(seq_id, request_id, prompt_ids, params, group_id, priority)
        seq.bad_words_token_ids = bad_words
        self.requests[request_id] = request = Request(seq)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first token: nothing before it to score
            self.runner.scoring.add(seq_id)
        self.scheduler.add(seq)
        return request_id

    def check_length(self, prompt_ids: list[int], max_tokens: int) -> None:
        """A request of this prompt and max_tokens fits the context, the cache and a step."""
        max_len = len(prompt_ids) + max_tokens
        if self.config.max_model_len is not None and max_len > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.config.max_model_len})"
            )
        if max_len > self.model.config.max_position_embeddings:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
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

    def _encode_word(self, word: str) -> list[int]:
        return self.tokenizer.encode(word, add_special_tokens=False)

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

    def step(self) -> list[TokenIdsOutput]:
        """Runs one scheduler step; returns the requests that got a token or finished. With
        async scheduling the tokens returned are those of the step launched by the call before.

        If the step raises, the requests it ran are aborted (their KV freed) and the error
        propagates: what they computed is unknown, and a failure that depends on the request
        would otherwise repeat at every later step.
        """
        start = time.perf_counter()
        out = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        self.num_steps += 1
        self.last_schedule = out
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
    ) -> list[TokenIdsOutput]:
        for seq in out.preempted:
            self.runner.preempt(seq)
        self.runner.swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
        self.num_preemptions += len(out.preempted)
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
        outputs = [self._output(seq) for seq in updated]
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
        samples = iter(step.sampled.read())  # `step` is done once its tokens are here
        scored = step.sampled.read_prompt()  # {} unless a prompt's logprobs were asked for
        self.scheduler.free_finished_in_flight()  # finished while `step` ran, which wrote them
        updated, finished = [], []
        for seq, _ in step.scheduled:
            sample = next(samples) if seq.seq_id in step.sampled.row_of else None
            if seq.is_finished:
                continue  # aborted, or stopped a step late: its token never reaches an output
            if scored and seq.seq_id in scored:
                self.requests[seq.request_id].prompt_logprobs += scored[seq.seq_id]
            if sample is None:
                continue
            seq.num_output_placeholders -= 1
            token = sample.token_id
            seq.token_ids.append(token)
            if sample.logprobs is not None:
                self.requests[seq.request_id].logprobs.append(sample.logprobs)
            updated.append(seq)
            reason = self._finish_reason(seq, token)  # stop strings: the output processor's
            if reason is not None:
                in_flight = next_step is not None and seq.seq_id in next_step.seq_ids
                self.scheduler.finish(seq, reason, in_flight)
                self.runner.release(seq)
                finished.append(seq)
        return updated, finished

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        # within min_tokens the sampler masks them; if it could not, they still end nothing
        if (token in params.stop_token_ids or is_eos) and seq.num_output_tokens > params.min_tokens:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _output(self, seq: Sequence) -> TokenIdsOutput:
        """The token this step added and its logprobs; no text, no prompt (the caller has it)."""
        reason = seq.finish_reason.value if seq.finish_reason else None
        request = self.requests[seq.request_id]
        new_logprobs = request.logprobs[-1:] if seq.params.logprobs is not None else None
        output = TokenIdsOutput(seq.request_id, seq.token_ids[-1:], new_logprobs, reason)
        if request.prompt_logprobs is not None and seq.num_output_tokens == 1:
            output.prompt_logprobs = request.prompt_logprobs  # complete: the prompt is computed
        return output


# `LLM`'s own keyword arguments; every other one is an engine argument (config.engine_config)
LLM_ARGUMENTS = ("model", "dtype", "device", "trace", "seed", "generation_config",
                 "override_generation_config")  # fmt: skip


class LLM:
    """Offline batch inference: `LLM("Qwen/Qwen3-0.6B").generate(prompts, params)`, vLLM's shape.

    `model`: a local Hugging Face directory or a hub id; None means the embedded SmolLM2.
    `dtype`: "auto" (bf16 on a bf16-capable GPU, else fp32), or "float32"/"bfloat16"/"float16".
    `seed`: seeds torch's random state, which requests without a seed of their own draw from
    (vLLM's engine seed); None leaves it as it is.
    `generation_config` (vLLM's): "auto" samples a call without `sampling_params` as the
    checkpoint's generation_config.json recommends (Qwen3: temperature 0.6, top_p 0.95, top_k
    20; `get_default_sampling_params`), "vllm" with `SamplingParams()`, or a directory whose
    generation_config.json to read; `override_generation_config` (vLLM's) sets some of those
    defaults over it ({"temperature": 0.5}).
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
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
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
        self.sampling_defaults = generation_defaults(model_dir, generation_config,
                                                     override_generation_config)  # fmt: skip
        if self.sampling_defaults:
            logger.info("sampling defaults from the model's generation config (without "
                        "sampling_params): %s", self.sampling_defaults)  # fmt: skip
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
        self.processor = OutputProcessor(tokenizer)  # no metrics offline
        self.requests: dict[str, LLMRequest] = {}
        self.parents: dict[str, ParentRequest] = {}  # requests for n > 1 completions
        self._parent_ids = itertools.count()
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

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forgets the prefix cache, so the next prompts compute every token (a
        benchmark's cold start). False, changing nothing, while requests hold KV blocks."""
        return self.engine.block_manager.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what `generate` and `chat` sample with when given no `sampling_params`."""
        return SamplingParams(**self.sampling_defaults)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Replies to one conversation or a list of them, rendered with the chat template.
        `tools` (vLLM's): OpenAI-style tool definitions the template renders; the reply's
        calls are its text (the server parses them: tool_calls.py). `chat_template` (vLLM's):
        a Jinja template instead of the checkpoint's. `continue_final_message` (vLLM's, with
        add_generation_prompt=False): the reply goes on with the final message."""
        conversations = check_conversations(messages)
        check_optional("chat_template_kwargs", chat_template_kwargs, dict)
        check_optional("tools", tools, list)
        check_optional("chat_template", chat_template, str)
        tokenizer = self.engine.tokenizer
        if chat_template is not None:
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = chat_template
        prompts = [
            tokenizer.apply_chat_template(
                c,
                add_generation_prompt,
                tools=tools,
                continue_final_message=continue_final_message,
                tokenize=True,  # the rendered template already holds the special tokens
                **(chat_template_kwargs or {}),
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of `prompts`.
        `priority` (vLLM's): one per prompt, lower first, under scheduling_policy "priority".

        All or nothing: if anything raises (a bad prompt, a model error, Ctrl-C), every request
        of this call is aborted before the error propagates, so none runs later by surprise.
        """
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompts, params = check_batch(prompts, sampling_params)
        if priority is None:
            priority = [0] * len(prompts)
        if not isinstance(priority, list | tuple) or len(priority) != len(prompts):
            raise ValueError(f"priority must be a list of one int per prompt ({len(prompts)})")
        ids: list[str] = []
        try:
            for p, sp, rank in zip(prompts, params, priority, strict=True):
                ids.append(self.add_request(p, sp, output_kind=RequestOutputKind.FINAL_ONLY,
                                            priority=rank))  # fmt: skip
            done: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
                while self.has_unfinished_requests():
                    for out in self.step():
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for i in ids:
                self.abort_request(i)
            raise
        return [done[i] for i in ids]

    def beam_search(
        self, prompts: Prompt | list[Prompt], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """vLLM's: each prompt's `params.beam_width` likeliest continuations, best first
        (beam_search.py). Every step is one `generate` of a token for each beam of each prompt;
        the beams' earlier tokens are prefix cache hits."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts, _ = check_batch(prompts, None)
        engine = self.engine
        searches = []
        for prompt in prompts:
            prompt_ids = engine._tokenize(prompt)
            engine.check_length(prompt_ids, params.max_tokens)  # before a step, not at the last
            searches.append(BeamSearch(prompt_ids, params, engine.tokenizer.eos_token_ids))
        step = params.step_params()
        for _ in tqdm(range(params.max_tokens), disable=not use_tqdm, desc="beam search"):
            running = [s for s in searches if not s.done]
            if not running:
                break
            beams = [beam.tokens for s in running for beam in s.beams]
            outs = iter(self.generate(beams, step, use_tqdm=False))
            for search in running:
                search.advance([next(outs).outputs[0].logprobs[0].top_logprobs
                                for _ in search.beams])  # fmt: skip
        decode = functools.partial(engine.tokenizer.decode, skip_special_tokens=True)
        return [search.result(decode) for search in searches]

    # -- one step at a time (vLLM v1's LLMEngine: the engine core + the output processor) ----

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        priority: int = 0,
    ) -> str:
        """Queues one request; raises (changing nothing) if it is malformed or can never run.
        With `params.n` > 1 it queues n, choice i seeded `seed + i` (vLLM's rule), whose outputs
        come back under one request id, each completion with its `index`. `priority`: lower runs
        first, under scheduling_policy "priority" (vLLM's)."""
        prompt = as_prompt("prompt", prompt)
        check_priority(priority, self.engine.config.scheduling_policy)
        check_optional("output_kind", output_kind, RequestOutputKind)
        check_optional("request_id", request_id, str)
        if request_id in self.parents or (request_id is not None and request_id in self.requests):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams) or params.n == 1:
            return self._add_one(prompt, params, request_id, output_kind, priority=priority)
        if request_id is None:
            request_id = f"parent-{next(self._parent_ids)}"
        parent = ParentRequest(request_id, [], params.n)
        try:
            for i in range(params.n):
                seed = None if params.seed is None else (params.seed + i) % SEED_LIMIT
                child = replace(params, n=1, seed=seed)
                child_id = self._add_one(prompt, child, f"{i}_{request_id}", output_kind,
                                         request_id, parent, i, priority)  # fmt: skip
                parent.child_ids.append(child_id)
        except BaseException:
            for child_id in parent.child_ids:
                self._abort_one(child_id)
            raise
        self.parents[request_id] = parent
        return request_id

    def _add_one(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None,
        output_kind: RequestOutputKind,
        group_id: str | None = None,
        parent: ParentRequest | None = None,
        index: int = 0,
        priority: int = 0,
    ) -> str:
        request_id = self.engine.add_request(prompt, params, request_id, group_id, priority)
        request = self.engine.requests[request_id]
        prompt_ids = request.seq.prompt_token_ids
        state = RequestState.start(request_id, 0, RequestOutputCollector(), self.engine.tokenizer,
                                   prompt_ids, params)  # fmt: skip
        self.processor.add(state)
        prompt_text = prompt if isinstance(prompt, str) else None
        self.requests[request_id] = LLMRequest(request, prompt_text, state, output_kind, parent,
                                               index)  # fmt: skip
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stops a request and frees its KV slots; unknown or finished ids are ignored. A request
        of n > 1 stops all its choices (naming one of them stops them all)."""
        child = self.requests.get(request_id)
        if child is not None and child.parent is not None:
            request_id = child.parent.request_id
        parent = self.parents.pop(request_id, None)
        for child_id in parent.child_ids if parent is not None else [request_id]:
            self._abort_one(child_id)

    def _abort_one(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.processor.remove([request_id])
        self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Runs one engine step and makes its text: a `DELTA` request's new text and token ids
        (and logprobs), if it got any, and a `FINAL_ONLY` request's whole completion once it
        finishes. A stop string found in the text ends the request here, and in the engine."""
        try:
            outputs = [self._core_output(out) for out in self.engine.step()]
        except BaseException:  # the engine aborted the requests the step ran: so does this
            for request_id in [i for i in self.requests if i not in self.engine.requests]:
                self.abort_request(request_id)
            raise
        outputs = [out for out in outputs if out is not None]
        finished, to_abort = self.processor.process_outputs(outputs, time.monotonic())
        for request_id in to_abort:  # the engine would go on generating
            self.engine.abort_request(request_id)
        finished_ids = {state.request_id for state in finished}
        results = []
        for out in outputs:
            llm_request, done = self.requests[out.request_id], out.request_id in finished_ids
            if llm_request.output_kind is RequestOutputKind.FINAL_ONLY and not done:
                continue  # its collector merges the deltas until it finishes
            if done:
                del self.requests[out.request_id]
            deltas = llm_request.state.collector.get_nowait()  # raises if its text failed
            result = self._request_output(llm_request, deltas[0])
            if llm_request.parent is not None:
                result = self._parent_output(llm_request, result, done)
            if result is not None:
                results.append(result)
        return results

    def _parent_output(
        self, child: LLMRequest, output: RequestOutput, done: bool
    ) -> RequestOutput | None:
        """A choice's output as its parent request's: its id, finished once every choice is;
        FINAL_ONLY: None until then, and then all n completions in index order."""
        parent = child.parent
        parent.num_unfinished -= done
        finished = parent.num_unfinished == 0
        if finished:
            del self.parents[parent.request_id]
        completions = output.outputs
        if child.output_kind is RequestOutputKind.FINAL_ONLY:
            parent.completions[child.index] = output.outputs[0]
            if not finished:
                return None
            completions = [parent.completions[i] for i in range(len(parent.child_ids))]
        return replace(output, request_id=parent.request_id, outputs=completions,
                                   finished=finished)  # fmt: skip

    def _core_output(self, out: TokenIdsOutput) -> EngineCoreOutput | None:
        """The engine's output as the output processor takes it (the engine core's message);
        None while a request detokenized at its end runs."""
        llm_request = self.requests[out.request_id]
        if not llm_request.detokenized_at_end:
            return EngineCoreOutput(out.request_id, out.new_token_ids, out.new_logprobs,
                                    out.finish_reason,
                                    prompt_logprobs=out.prompt_logprobs)  # fmt: skip
        if out.finish_reason is None:
            return None
        request = llm_request.request
        logprobs = list(request.logprobs) if request.seq.params.logprobs is not None else None
        return EngineCoreOutput(out.request_id, request.seq.output_token_ids, logprobs,
                                out.finish_reason,
                                prompt_logprobs=request.prompt_logprobs)  # fmt: skip

    def _request_output(self, llm_request: LLMRequest, delta: OutputDelta) -> RequestOutput:
        seq = llm_request.request.seq
        logprobs = None if delta.logprobs is None else list(delta.logprobs)
        cumulative = None  # every token's so far: this output's added to the earlier ones'
        if logprobs is not None:
            llm_request.cumulative_logprob += sum(lp.logprob for lp in logprobs)
            cumulative = llm_request.cumulative_logprob
        completion = CompletionOutput(llm_request.index, delta.text, list(delta.token_ids),
                                      delta.finish_reason, logprobs, delta.stop_reason,
                                      cumulative)  # fmt: skip
        cached = seq.num_cached_tokens if seq.num_cached_tokens >= 0 else None
        prompt_logprobs = llm_request.state.collector.prompt_logprobs.get(0)
        return RequestOutput(seq.request_id, llm_request.prompt, seq.prompt_token_ids,
                             [completion], delta.finish_reason is not None, cached,
                             prompt_logprobs)  # fmt: skip


def check_batch(
    prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
) -> tuple[list[Prompt], list[SamplingParams]]:
    """`generate`'s arguments as one list of prompts and one of params, each checked by index.

    A bare string or prompt dict is one prompt (as in vLLM); bytes are not text and are refused.
    """
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    if not isinstance(prompts, list | tuple):
        raise TypeError(f"prompts must be a str or a list of prompts, got {type(prompts).__name__}")
    prompts = [as_prompt(f"prompts[{i}]", prompt) for i, prompt in enumerate(prompts)]
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
