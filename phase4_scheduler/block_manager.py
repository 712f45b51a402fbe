"""Block manager: KV cache memory as one contiguous region of token slots per sequence.

Problem: continuous batching lets sequences come and go, so their keys/values live in one shared
pool of token slots (kv_cache.py) that they borrow and give back. Someone must decide which slots
each sequence holds, and say when the pool is too full for a sequence to grow.
Idea: contiguous allocation, malloc without paging. A sequence owns one region
[start, start + capacity) of slots; its token at position p lives in slot start + p. On admission
the manager reserves the sequence's maximum length (prompt + max_tokens) in the first gap that
large, so that it never has to grow; when no gap is that large, it reserves only what is needed
now, in the largest gap. A region grows in place while the slots after it are free;
when they are not, it moves to a gap large enough (realloc: its keys/values are copied there, see
`RegionMove`); when no gap is large enough, the scheduler must preempt someone.
Reserved-but-unused slots and the gaps between regions are wasted (fragmentation). Phase 5
replaces this file with fixed-size blocks behind the same interface.

Invariants (check_invariants): regions are disjoint and inside the pool; each region uses no more
slots than it reserved.
"""

from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class Region:
    start: int
    capacity: int
    used: int = 0  # slots holding keys/values: the sequence's computed tokens, then this step's


@dataclass(frozen=True)
class RegionMove:
    """A region that moved to grow: copy `num_slots` keys/values from `src_start` to `dst_start`
    before the step runs. The two ranges may overlap (a lone sequence sliding to slot 0)."""

    src_start: int
    dst_start: int
    num_slots: int


class BlockManager:
    """Hands out contiguous slot regions; knows nothing about tensors."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.regions: dict[int, Region] = {}  # seq_id -> its region

    def _gaps(self, ignoring: int | None = None) -> list[tuple[int, int]]:
        """Free (start, length) ranges in slot order, counting `ignoring`'s region as free."""
        gaps, cursor = [], 0
        taken = [r for seq_id, r in self.regions.items() if seq_id != ignoring]
        for r in sorted(taken, key=lambda r: r.start):
            if r.start > cursor:
                gaps.append((cursor, r.start - cursor))
            cursor = r.start + r.capacity
        if cursor < self.num_slots:
            gaps.append((cursor, self.num_slots - cursor))
        return gaps

    def _place(self, needed: int, wanted: int, ignoring: int | None = None) -> Region | None:
        """A region of `wanted` slots in the first gap that large, else of `needed` slots in the
        largest gap; None if no gap holds `needed`. A gap that follows another region is split:
        the new region sits in the middle of the spare room, so that both it and the region
        before it can grow in place (packing it against its neighbour made the neighbour evict it
        one step later)."""
        gaps = self._gaps(ignoring)
        roomy = [(start, length) for start, length in gaps if length >= wanted]
        if roomy:
            (start, length), size = roomy[0], wanted
        else:
            (start, length), size = max(gaps, key=lambda g: g[1], default=(0, 0)), needed
            if length < needed:
                return None
        follows_a_region = start > 0
        return Region(start + (length - size) // 2 if follows_a_region else start, size)

    @staticmethod
    def _max_len(seq: Sequence) -> int:
        return seq.num_prompt_tokens + seq.params.max_tokens

    def can_allocate(self, num_tokens: int, watermark: int) -> bool:
        """Room for `num_tokens` tokens of a new sequence, plus `watermark` slots that the
        running sequences keep for their next step?"""
        return self._place(num_tokens + watermark, num_tokens + watermark) is not None

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Gives `seq` a region for all its current tokens, holding its first `num_tokens` (this
        step's chunk). Precondition: can_allocate(seq.num_tokens, ...)."""
        assert seq.seq_id not in self.regions
        region = self._place(seq.num_tokens, self._max_len(seq))
        region.used = num_tokens
        self.regions[seq.seq_id] = region

    def can_append_slots(self, seq: Sequence, num_new: int) -> bool:
        r = self.regions[seq.seq_id]
        needed = seq.num_computed_tokens + num_new
        return self._room_after(r) >= needed or self._place(needed, needed, seq.seq_id) is not None

    def append_slots(self, seq: Sequence, num_new: int) -> RegionMove | None:
        """Grows `seq`'s region to hold num_computed_tokens + num_new tokens: in place when the
        slots after it are free, else by moving it (returned: the copy the runner must make).
        Precondition: can_append_slots."""
        r = self.regions[seq.seq_id]
        needed = seq.num_computed_tokens + num_new
        move = None
        if self._room_after(r) < needed:
            wanted = max(needed, self._max_len(seq))
            new = self._place(needed, wanted, seq.seq_id)
            move = RegionMove(r.start, new.start, r.used)
            self.regions[seq.seq_id] = r = new
        r.used = needed
        r.capacity = max(r.capacity, needed)
        return move

    def _room_after(self, region: Region) -> int:
        """How large the region could grow in place: up to the next region or the pool's end."""
        later = [r.start for r in self.regions.values() if r.start > region.start]
        return min(later, default=self.num_slots) - region.start

    def free(self, seq: Sequence) -> None:
        del self.regions[seq.seq_id]

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
