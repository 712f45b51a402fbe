"""Sequence: one request's tokens and its progress through the engine.

Problem: once requests join and leave a running batch at different times (continuous batching),
the engine needs per-request state, not per-batch state.
Idea (vLLM v1's vocabulary): a sequence is its token ids plus one counter, `num_computed_tokens`,
the number of tokens whose keys/values are in the KV cache. There is no "prefill phase" or
"decode phase": each step the scheduler lets `num_computed_tokens` catch up towards `num_tokens`
by some amount; when it catches up, the model's output for the last token is sampled and appended.

Lifecycle: WAITING -> RUNNING -> FINISHED, and RUNNING -> WAITING when preempted (its cache is
dropped and `num_computed_tokens` goes back to 0: the tokens are recomputed later), or
RUNNING -> SWAPPED -> RUNNING when preempted in swap mode (its blocks wait in CPU memory).

Overlap scheduling (engine.py): a token sampled by a step still running on the device is counted
in `num_output_placeholders` (vLLM's name) until the host reads it; the scheduler treats it as a
token that exists, the model runner feeds it to the next step from the device.

Fair share (scheduler.py): the sequences of one client request (its n choices of each of its
prompts) share a `group_id`, vLLM v0's SequenceGroup; a sequence added on its own is a group of one.

Invariants: 0 <= num_computed_tokens <= num_tokens + num_output_placeholders;
num_tokens = num_prompt_tokens + outputs (the tokens the host knows).
"""

import enum

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks copied to the CPU (phase 5, swap mode)
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the caller gave up on it


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        group_id: str | None = None,
        priority: int = 0,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.group_id = request_id if group_id is None else group_id  # None: a group of its own
        self.priority = priority  # lower runs first, under scheduling_policy "priority" (vLLM's)
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # sampled on the device, not yet read by the host
        self.num_cached_tokens = -1  # found in the prefix cache at its first admission (vLLM's)
        self.num_prompt_scored = 0  # prompt_logprobs: positions whose next token has been scored
        self.bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # each bad word, tokenized
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
