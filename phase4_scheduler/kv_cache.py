"""KV cache as one shared pool of token slots, with a contiguous region per sequence.

Problem: phase 3 gave every batch row a cache as long as the longest request, and the batch could
not change. Continuous batching (phase 4) needs sequences to come and go, so their keys/values must
live in one shared pool that sequences borrow from and give back.
Idea: per layer one (num_slots, num_kv_heads, head_dim) tensor. Each running sequence owns one
contiguous region [start, start + capacity) of slots; its token at position p lives in slot
start + p. On admission the allocator tries to reserve the sequence's maximum length
(prompt + max_tokens) so that it can always grow; when the pool is too full for that, it reserves
only what is needed now and the region grows in place while the slots after it are free.
A region that cannot grow forces the scheduler to preempt someone.

This is contiguous memory allocation (malloc without paging): reserved-but-unused slots and gaps
between regions are wasted. Phase 5 replaces it with fixed-size pages (blocks).

Invariants (check_invariants): regions are disjoint and inside the pool;
each sequence's used slots <= its capacity.
"""

from dataclasses import dataclass

import torch


class KVCache:
    """The slot pool's tensors: keys and values of every layer, indexed by slot."""

    def __init__(self, num_layers, num_slots, num_kv_heads, head_dim, dtype, device):
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
        """Writes new keys/values (N, H_kv, D) into their slots (N,)."""
        self.k[layer][slot_mapping] = k
        self.v[layer][slot_mapping] = v


@dataclass
class Region:
    start: int
    capacity: int
    used: int = 0  # slots holding keys/values (= the sequence's num_computed_tokens + new)


class SlotAllocator:
    """Hands out contiguous slot regions; knows nothing about tensors or sequences' tokens."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.regions: dict[int, Region] = {}  # seq_id -> its region

    def _gaps(self) -> list[tuple[int, int]]:
        """Free (start, length) ranges between regions, in slot order."""
        gaps, cursor = [], 0
        for r in sorted(self.regions.values(), key=lambda r: r.start):
            if r.start > cursor:
                gaps.append((cursor, r.start - cursor))
            cursor = r.start + r.capacity
        if cursor < self.num_slots:
            gaps.append((cursor, self.num_slots - cursor))
        return gaps

    def can_allocate(self, num_slots: int) -> bool:
        return any(length >= num_slots for _, length in self._gaps())

    def allocate(self, seq_id: int, needed: int, wanted: int) -> None:
        """Reserves `wanted` slots (the sequence's max length) in the first gap that large, else
        `needed` slots at the start of the largest gap, leaving the most room to grow in place.
        Precondition: can_allocate(needed)."""
        assert seq_id not in self.regions
        gaps = self._gaps()
        roomy = [start for start, length in gaps if length >= wanted]
        if roomy:
            self.regions[seq_id] = Region(roomy[0], wanted)
        else:
            start, _ = max(gaps, key=lambda g: g[1])
            self.regions[seq_id] = Region(start, needed)

    def can_append(self, seq_id: int, num_new: int) -> bool:
        r = self.regions[seq_id]
        return r.used + num_new <= r.capacity or self._room_after(r) >= r.used + num_new

    def append(self, seq_id: int, num_new: int) -> None:
        """Makes room for `num_new` more tokens, growing in place. Precondition: can_append."""
        r = self.regions[seq_id]
        r.used += num_new
        r.capacity = max(r.capacity, r.used)

    def _room_after(self, region: Region) -> int:
        """How large the region could grow in place: up to the next region or the pool's end."""
        later = [r.start for r in self.regions.values() if r.start > region.start]
        return min(later, default=self.num_slots) - region.start

    def free(self, seq_id: int) -> None:
        del self.regions[seq_id]

    def slot(self, seq_id: int, position: int) -> int:
        return self.regions[seq_id].start + position

    @property
    def num_used_slots(self) -> int:
        return sum(r.used for r in self.regions.values())

    @property
    def num_reserved_slots(self) -> int:
        return sum(r.capacity for r in self.regions.values())

    def check_invariants(self) -> None:
        end = 0
        for r in sorted(self.regions.values(), key=lambda r: r.start):
            assert r.start >= end, f"regions overlap at slot {r.start}"
            assert 0 <= r.used <= r.capacity, f"region {r} uses more than it reserved"
            end = r.start + r.capacity
        assert end <= self.num_slots, "a region runs past the end of the pool"
