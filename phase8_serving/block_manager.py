"""Block manager: KV cache memory in fixed-size pages, shared between prompts with a common prefix.

Problem: phase 4 gave each sequence one contiguous region sized for its maximum length. Most of
that reservation is never used (requests stop early), the gaps between regions are too small for
new requests (fragmentation), and two requests with the same system prompt compute and store the
same keys/values twice.
Idea (PagedAttention, Kwon et al., 2023): cut the cache into blocks of `block_size` token slots.
A sequence owns a `block_table` (logical block i -> physical block id), gets a new block only when
its last one is full, and gives them all back when it finishes or is preempted: at most one
partly filled block per sequence is wasted. This is virtual memory: page tables, pages allocated
on demand.

Prefix caching: a full block is named by a chained hash of (parent block's hash, its token ids),
so equal hashes mean equal prefixes. A new request maps cached blocks of its prompt into its table
(ref_cnt + 1) and skips computing them, like processes sharing a library's pages. A freed block
keeps its contents and hash, and is reused only when the free queue reaches it
(least recently freed first: LRU eviction). The stored parent hash and tokens are compared on
every hit, so a hash collision can never hand a request someone else's keys/values.

Swap (vLLM's preemption_mode="swap"): a preempted sequence's blocks can be copied to a second,
CPU-side pool instead of being dropped; `swap_out` returns the (GPU block, CPU block) copies to make
and frees the GPU blocks, `swap_in` later gives the sequence fresh GPU blocks and returns the
(CPU block, GPU block) copies back. Swapped-in blocks are private until `cache_full_blocks`
registers them again. Like paging to disk when RAM runs out, instead of killing the process.

Invariants (check_invariants):
- free + referenced = all blocks; a block is in the free queue iff its ref_cnt is 0;
- a block's ref_cnt equals the number of block tables that hold it;
- a block registered under a hash holds the keys/values of exactly its stored tokens (or will,
  once the steps already launched on the device are done: every reader is launched later);
- free CPU blocks + CPU blocks held by swapped-out sequences = all CPU blocks, each held once.
"""

from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and computed
    parent_hash: int | None = None  # the previous block's hash (None for a sequence's first)
    token_ids: tuple[int, ...] = ()  # the tokens whose keys/values it holds, when hashed


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first (eviction order). OrderedDict: O(1) removal of a
        # cached block from the middle when a new request hits it.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> physical block ids
        self.num_cached_blocks: dict[int, int] = {}  # seq_id -> leading blocks already hashed
        self.num_slots_used: dict[int, int] = {}  # seq_id -> tokens its table holds
        self.num_queried_tokens = 0  # prefix-cache statistics
        self.num_hit_tokens = 0
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks = list(range(num_cpu_blocks))
        self.cpu_block_tables: dict[int, list[int]] = {}  # seq_id -> CPU blocks, when swapped out

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def _blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    # exercise 5.2: the prefix cache's hash-chain lookup
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq`'s tokens. The last token is never matched:
        its logits are needed to sample, so at least one token must be computed."""
        if not self.enable_prefix_caching:
            return []
        matched, parent = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self.hash_to_block.get(chain_hash(parent, tokens))
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tokens:
                break  # a hash collision: not our prefix
            matched.append(block_id)
            parent = block.block_hash
        return matched

    def can_allocate(self, cached: list[int], num_tokens: int, watermark: int) -> bool:
        """Room for `num_tokens` of a new sequence's tokens, reusing the `cached` blocks, with
        `watermark` blocks still free afterwards for the running sequences' next step?"""
        new_blocks = self._blocks_needed(num_tokens) - len(cached)
        reclaimed = sum(1 for b in cached if self.blocks[b].ref_cnt == 0)  # leave the free queue
        return new_blocks + watermark <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence, cached: list[int], num_tokens: int) -> None:
        """Builds `seq`'s block table: the cached prefix, then fresh blocks up to `num_tokens`.
        Precondition: can_allocate(cached, n, ...) for some n >= num_tokens;
        seq.num_computed_tokens counts the cached prefix."""
        assert seq.seq_id not in self.block_tables
        for block_id in cached:
            self._take(block_id)
        self.block_tables[seq.seq_id] = list(cached)
        self.num_cached_blocks[seq.seq_id] = len(cached)
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += len(cached) * self.block_size
        self.append_slots(seq, num_tokens - len(cached) * self.block_size)

    def can_append_slots(self, seq: Sequence, num_new: int) -> bool:
        table = self.block_tables[seq.seq_id]
        needed = self._blocks_needed(seq.num_computed_tokens + num_new) - len(table)
        return needed <= self.num_free_blocks

    # exercise 5.1: block allocation
    def append_slots(self, seq: Sequence, num_new: int) -> None:
        """Grows the table to hold num_computed_tokens + num_new tokens. Precondition:
        can_append_slots (or can_allocate, when called from allocate)."""
        table = self.block_tables[seq.seq_id]
        self.num_slots_used[seq.seq_id] = seq.num_computed_tokens + num_new
        while len(table) < self._blocks_needed(seq.num_computed_tokens + num_new):
            block_id = next(iter(self.free_block_queue))  # the least recently freed
            self._evict(block_id)
            self._take(block_id)
            table.append(block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_block_queue[block_id]
        block.ref_cnt += 1

    def _evict(self, block_id: int) -> None:
        """Forgets a free block's cached contents before it is reused for other tokens."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.hash_to_block[block.block_hash]
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the hashes of `seq`'s blocks that became full of computed tokens, in order.
        Computed means computed by a step already launched (a later reader runs after it on the
        device), and only tokens the host knows count: with overlap scheduling a step may compute
        a token sampled by the step before it, not read yet. A block is registered only under
        its own table's previous block, itself registered: if that hash is already taken (an
        identical block cached by another sequence, or a collision), this block and every later
        one stay private to `seq`."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[seq.seq_id]
        done = self.num_cached_blocks[seq.seq_id]
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for i in range(done, num_full):
            parent = self.blocks[table[i - 1]].block_hash if i else None
            if i and parent is None:
                break  # the previous block is private: no verifiable chain runs through it
            block = self.blocks[table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = chain_hash(parent, tokens)
            if block_hash in self.hash_to_block:
                break
            block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, tokens
            self.hash_to_block[block_hash] = block.block_id
        self.num_cached_blocks[seq.seq_id] = max(done, num_full)

    def free(self, seq: Sequence) -> None:
        """Returns `seq`'s blocks. The tail goes to the free queue first, so the shared prefix
        blocks, freed last, are evicted last."""
        for block_id in reversed(self.block_tables.pop(seq.seq_id)):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block_id] = None
        del self.num_cached_blocks[seq.seq_id]
        del self.num_slots_used[seq.seq_id]

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (vLLM's: a benchmark's cold start, or weights changed
        under the cache). Only while no sequence holds a block: False, changing nothing, if one
        does."""
        if self.num_free_blocks != len(self.blocks):
            return False
        for block_id in list(self.hash_to_block.values()):
            self._evict(block_id)
        return True  # the hit statistics are counters (metrics.py): they go on

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.block_tables[seq.seq_id]) <= len(self.free_cpu_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Moves `seq`'s table to CPU blocks and frees its GPU blocks; returns the (GPU block,
        CPU block) copies, to be made before anything runs in the freed blocks."""
        table = self.block_tables[seq.seq_id]
        cpu_table = [self.free_cpu_blocks.pop() for _ in table]
        self.cpu_block_tables[seq.seq_id] = cpu_table
        copies = list(zip(table, cpu_table, strict=True))
        self.free(seq)
        return copies

    def can_swap_in(self, seq: Sequence, num_new: int, watermark: int) -> bool:
        """Room on the GPU for `seq`'s swapped blocks plus `num_new` tokens, with `watermark`
        blocks still free afterwards?"""
        needed = self._blocks_needed(seq.num_computed_tokens + num_new)
        return needed + watermark <= self.num_free_blocks

    def swap_in(self, seq: Sequence, num_new: int) -> list[tuple[int, int]]:
        """Gives `seq` fresh GPU blocks for its swapped ones and room for `num_new` more tokens;
        returns the (CPU block, GPU block) copies. Precondition: can_swap_in."""
        cpu_table = self.cpu_block_tables.pop(seq.seq_id)
        self.block_tables[seq.seq_id] = []
        self.num_cached_blocks[seq.seq_id] = 0  # private until cache_full_blocks registers them
        self.append_slots(seq, num_new)
        self.free_cpu_blocks += cpu_table
        return list(zip(cpu_table, self.block_tables[seq.seq_id], strict=False))

    def free_swapped(self, seq: Sequence) -> None:
        """Returns a swapped-out sequence's CPU blocks (it finished or was aborted)."""
        self.free_cpu_blocks += self.cpu_block_tables.pop(seq.seq_id)

    # exercise 5.3: the slot mapping
    def slot(self, seq_id: int, position: int) -> int:
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - self.num_free_blocks

    @property
    def num_used_slots(self) -> int:
        """Tokens held by all tables (a shared prefix counts once per sequence using it)."""
        return sum(self.num_slots_used.values())

    @property
    def num_reserved_slots(self) -> int:
        return self.num_used_blocks * self.block_size

    def check_invariants(self) -> None:
        refs = [0] * len(self.blocks)
        for table in self.block_tables.values():
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], f"{block}: ref_cnt != tables holding it"
            assert (block.ref_cnt == 0) == (block.block_id in self.free_block_queue), block
        assert self.num_free_blocks + sum(r > 0 for r in refs) == len(self.blocks)
        for block_hash, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            assert block.block_hash == block_hash
            assert chain_hash(block.parent_hash, block.token_ids) == block_hash
            # A child is freed before its parent, so it is evicted first: no orphan in the cache.
            assert block.parent_hash is None or block.parent_hash in self.hash_to_block, block
            assert len(block.token_ids) == self.block_size
        held = [b for table in self.cpu_block_tables.values() for b in table]
        assert sorted(held + self.free_cpu_blocks) == list(range(self.num_cpu_blocks))
