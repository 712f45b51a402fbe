"""The state pool: the fixed-size recurrent memory of a hybrid model's DeltaNet layers.

Problem: a Gated DeltaNet layer (gated_delta.py) remembers a sequence's whole history in a state of
fixed size: per layer a conv state (channels, width - 1) and a recurrent state (heads, d_k, d_v).
That is not a KV cache. It does not grow with the context, so there is nothing to page; it is
overwritten in place by every token, so it cannot be shared between sequences with a common
prefix, nor cut back to an earlier position (the state after token 100 no longer knows what it
was after token 60). A block table has nothing to point at.
Idea (vLLM's mamba state): one slot per running sequence. The pool holds, per DeltaNet layer, a
conv tensor (num_slots, channels, width - 1) in the model's dtype and a recurrent tensor
(num_slots, heads, d_k, d_v) in float32 (it integrates thousands of small updates). A sequence
takes a slot when it is first scheduled and holds it until it finishes; the model reads and
writes its state through `ForwardBatch.state_slots`. With `max_num_seqs` slots, a running
sequence always finds one. Like a process's registers beside its pages: saved and restored
whole, never paged.

Preemption follows the KV cache's mode: recompute frees the slot and zeroes it (the prompt is
prefilled again from a zero state); swap copies the slot's tensors to the CPU with its blocks and
back into a free slot when it resumes.

Invariants (check_invariants): a slot is free or held by exactly one sequence; free slots hold
zeros; a swapped sequence holds no slot.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateShape:
    """What one DeltaNet layer keeps per sequence."""

    conv_channels: int  # q, k and v channels that the causal conv1d mixes
    conv_width: int  # the conv kernel's width; its state is the last width - 1 inputs
    num_heads: int  # value heads
    key_dim: int
    value_dim: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv = self.conv_channels * (self.conv_width - 1) * dtype.itemsize
        recurrent = self.num_heads * self.key_dim * self.value_dim * torch.float32.itemsize
        return conv + recurrent


class StatePool:
    def __init__(self, shape: StateShape, num_layers: int, num_slots: int, dtype, device):
        self.shape = shape
        self.num_slots = num_slots
        self.dtype = dtype
        conv = (num_slots, shape.conv_channels, shape.conv_width - 1)
        recurrent = (num_slots, shape.num_heads, shape.key_dim, shape.value_dim)
        self.conv = [torch.zeros(conv, dtype=dtype, device=device) for _ in range(num_layers)]
        self.recurrent = [
            torch.zeros(recurrent, dtype=torch.float32, device=device) for _ in range(num_layers)
        ]
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.slots: dict[int, int] = {}  # seq_id -> its slot
        self.swapped: dict[int, list[torch.Tensor]] = {}  # seq_id -> its state, on the CPU

    @property
    def memory_bytes(self) -> int:
        return self.num_slots * len(self.conv) * self.shape.bytes_per_slot(self.dtype)

    def slot(self, seq_id: int) -> int:
        """The sequence's slot; a sequence scheduled for the first time (or resuming from a swap)
        takes a free one here."""
        if seq_id in self.slots:
            return self.slots[seq_id]
        if not self.free_slots:
            raise RuntimeError(f"no free state slot (all {self.num_slots} are held)")
        slot = self.slots[seq_id] = self.free_slots.pop()
        saved = self.swapped.pop(seq_id, None)
        if saved is not None:
            for pool, tensor in zip(self.conv + self.recurrent, saved, strict=True):
                pool[slot] = tensor.to(pool.device)
        return slot

    def free(self, seq_id: int) -> None:
        """Zeroes and frees the sequence's slot (finished, aborted, or preempted to recompute);
        drops its swapped-out copy if it has one."""
        self.swapped.pop(seq_id, None)
        slot = self.slots.pop(seq_id, None)
        if slot is None:
            return
        for pool in self.conv + self.recurrent:
            pool[slot] = 0  # the next holder starts from an empty memory
        self.free_slots.append(slot)

    def swap_out(self, seq_id: int) -> None:
        """Copies the sequence's state to the CPU and frees its slot (preempted by swapping)."""
        slot = self.slots[seq_id]
        saved = [pool[slot].to("cpu", copy=True) for pool in self.conv + self.recurrent]
        self.free(seq_id)
        self.swapped[seq_id] = saved

    def check_invariants(self, running_seq_ids: set[int] | None = None) -> None:
        held = list(self.slots.values())
        assert len(set(held)) == len(held), "a slot is held twice"
        assert set(held).isdisjoint(self.free_slots), "a held slot is also free"
        assert len(held) + len(self.free_slots) == self.num_slots, "a slot went missing"
        assert set(self.slots).isdisjoint(self.swapped), "a swapped sequence holds a slot"
        if running_seq_ids is not None:
            assert set(self.slots) == running_seq_ids, "slots and running sequences differ"
        for pool in self.conv + self.recurrent:
            assert not pool[self.free_slots].any(), "a free slot holds state"
