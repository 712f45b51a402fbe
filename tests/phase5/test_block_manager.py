"""Phase 5 block manager: explicit scenarios, then hypothesis driving it as a state machine.

No model runs here. `Driver` does to the `BlockManager` exactly what the scheduler and the engine
do (match a prefix, allocate, append slots, advance `num_computed_tokens`, register full blocks,
free), and keeps a shadow of the KV cache: for every physical slot, the token prefix whose
key/value it holds (the key/value at position p depends on tokens 0..p). A sequence must only ever
see its own prefix in its slots; that is the property prefix caching must never break, checked
with real hashes and with a deliberately colliding hash.
"""

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from phase5_paged import block_manager as bm_module
from phase5_paged.block_manager import BlockManager
from phase5_paged.sampling import SamplingParams
from phase5_paged.sequence import Sequence


class Driver:
    """The scheduler's and the engine's side of the block manager, with a shadow KV cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the prefix its key/value was made from
        self.ids = itertools.count()

    def new_seq(self, tokens) -> Sequence:
        seq_id = next(self.ids)
        return Sequence(seq_id, str(seq_id), list(tokens), SamplingParams(max_tokens=1 << 20))

    def admit(self, seq: Sequence, num_new: int | None = None) -> list[int] | None:
        """Scheduler._admit_waiting + one engine step; None when it does not fit (seq waits)."""
        cached = self.bm.match_prefix(seq)
        num_computed = len(cached) * self.bm.block_size
        assert num_computed < seq.num_tokens, "matched the whole sequence"
        self.check_prefix(seq, cached, num_computed)  # the matched blocks hold seq's own prefix
        remaining = seq.num_tokens - num_computed
        num_new = remaining if num_new is None else min(num_new, remaining)
        if not self.bm.can_allocate(cached, num_computed + num_new, watermark=0):
            self.bm.check_invariants()
            return None
        seq.num_computed_tokens = num_computed
        self.bm.allocate(seq, cached, num_computed + num_new)
        self.compute(seq, num_new)
        return cached

    def extend(self, seq: Sequence, num_new: int) -> bool:
        """Scheduler._schedule_running + one engine step; False when there is no room."""
        num_new = min(num_new, seq.num_tokens - seq.num_computed_tokens)
        if not self.bm.can_append_slots(seq, num_new):
            return False
        self.bm.append_slots(seq, num_new)
        self.compute(seq, num_new)
        return True

    def compute(self, seq: Sequence, num_new: int) -> None:
        """The forward pass writes keys/values of the new tokens; the engine registers blocks."""
        start = seq.num_computed_tokens
        for p in range(start, start + num_new):
            self.kv[self.bm.slot(seq.seq_id, p)] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens += num_new
        self.bm.cache_full_blocks(seq)
        self.bm.check_invariants()
        self.check_own_prefix(seq)
        self.check_cache()

    def sample(self, seq: Sequence, token: int) -> None:
        assert seq.num_computed_tokens == seq.num_tokens
        seq.token_ids.append(token)

    def free(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0  # preempted or finished: its cache is gone
        self.bm.check_invariants()

    def check_own_prefix(self, seq: Sequence) -> None:
        self.check_prefix(seq, self.bm.block_tables[seq.seq_id], seq.num_computed_tokens)

    def check_prefix(self, seq: Sequence, table: list[int], num_tokens: int) -> None:
        """The first `num_tokens` slots reached through `table` hold `seq`'s own prefixes."""
        size = self.bm.block_size
        for p in range(num_tokens):
            slot = table[p // size] * size + p % size
            assert self.kv.get(slot) == tuple(seq.token_ids[: p + 1]), (
                f"seq {seq.seq_id} position {p}: its slot holds another prefix's key/value"
            )

    def check_cache(self) -> None:
        """Every registered block holds the keys/values of the prefix its hash chain names."""
        bm, prefixes = self.bm, {None: ()}
        pending = dict(bm.hash_to_block)
        while pending:  # parents first: a chain's prefix is its parent's prefix + its tokens
            ready = [h for h, b in pending.items() if bm.blocks[b].parent_hash in prefixes]
            assert ready, "a registered block's parent is not registered"
            for h in ready:
                block = bm.blocks[pending.pop(h)]
                prefixes[h] = prefixes[block.parent_hash] + block.token_ids
                for j in range(bm.block_size):
                    slot = block.block_id * bm.block_size + j
                    start = len(prefixes[h]) - bm.block_size
                    assert self.kv.get(slot) == prefixes[h][: start + j + 1], (
                        f"block {block.block_id} is cached as a prefix it does not hold"
                    )


def ref_counts_match_tables(bm: BlockManager) -> None:
    for block in bm.blocks:
        holders = sum(table.count(block.block_id) for table in bm.block_tables.values())
        assert block.ref_cnt == holders


# ---------------------------------------------------------------------------------------------
# Explicit scenarios


def test_append_slots_takes_the_least_recently_freed_block_and_forgets_its_hash():
    """Allocation alone, with no prefix lookup and no slot mapping: a table grows a block per
    block_size tokens, each taken from the front of the free queue, and a block that leaves the
    queue leaves the prefix cache too."""
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = lambda i, tokens: Sequence(i, str(i), tokens, SamplingParams(max_tokens=8))  # noqa: E731
    a = seq(0, [1, 2, 3])
    bm.allocate(a, [], 3)
    assert bm.block_tables[0] == [0, 1] and bm.num_slots_used[0] == 3
    a.num_computed_tokens = 3
    bm.append_slots(a, 1)  # the 4th token fits in block 1
    assert bm.block_tables[0] == [0, 1] and bm.num_slots_used[0] == 4
    a.token_ids.append(4)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)  # blocks 0 and 1 now hold [1, 2] and [3, 4] for any later prompt
    bm.free(a)  # tail first: the free queue is 2, 3, 1, 0
    bm.check_invariants()
    b = seq(1, [9, 9, 9, 9, 9])
    bm.allocate(b, [], 5)
    assert bm.block_tables[1] == [2, 3, 1]  # least recently freed first; block 0 stays cached
    assert [bm.blocks[i].block_id for i in bm.hash_to_block.values()] == [0]
    bm.check_invariants()


def test_slot_walks_the_block_table():
    """Position p lives in the table's block p // block_size, at offset p % block_size: a page
    table walk, whatever physical order the blocks are in."""
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.block_tables[7] = [5, 0, 3]
    slots = [bm.slot(7, p) for p in range(12)]
    assert slots == [20, 21, 22, 23, 0, 1, 2, 3, 12, 13, 14, 15]


@pytest.mark.parametrize("num_blocks_of_prompt", [1, 2, 3])
def test_prompt_length_a_multiple_of_block_size(num_blocks_of_prompt):
    d = Driver(num_blocks=8, block_size=4)
    prompt = list(range(10, 10 + 4 * num_blocks_of_prompt))
    a = d.new_seq(prompt)
    d.admit(a)
    assert len(d.bm.block_tables[a.seq_id]) == num_blocks_of_prompt  # exactly full: no spare
    assert d.bm.num_cached_blocks[a.seq_id] == num_blocks_of_prompt
    d.sample(a, 99)
    assert d.extend(a, 1)  # the first decode token opens a new block
    assert len(d.bm.block_tables[a.seq_id]) == num_blocks_of_prompt + 1
    # The same prompt again: every block is cached, but the last token must still be computed
    # (its logits pick the next token), so the last block is not matched.
    b = d.new_seq(prompt)
    cached = d.admit(b)
    assert cached == d.bm.block_tables[a.seq_id][: num_blocks_of_prompt - 1]
    assert d.bm.num_hit_tokens == 4 * (num_blocks_of_prompt - 1)
    assert b.num_computed_tokens == b.num_tokens
    ref_counts_match_tables(d.bm)


def test_prompt_one_token_longer_than_a_block_matches_that_block():
    d = Driver(num_blocks=8, block_size=4)
    a = d.new_seq([1, 2, 3, 4, 5])
    d.admit(a)
    b = d.new_seq([1, 2, 3, 4, 6])
    assert d.admit(b) == d.bm.block_tables[a.seq_id][:1]
    assert d.bm.blocks[d.bm.block_tables[a.seq_id][0]].ref_cnt == 2
    assert d.bm.block_tables[a.seq_id][1] != d.bm.block_tables[b.seq_id][1]  # own partial block


def test_fully_cached_prompt_still_computes_its_last_token():
    d = Driver(num_blocks=8, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # 2 full blocks + 1 token
    a = d.new_seq(prompt)
    d.admit(a)
    d.free(a)  # finished: its blocks stay cached in the free queue
    b = d.new_seq(prompt)
    cached = d.bm.match_prefix(b)
    assert len(cached) == 2 and b.num_tokens - 4 * len(cached) == 1
    d.admit(b)
    assert d.bm.num_hit_tokens == 8


def test_preempting_a_sequence_that_shares_blocks_leaves_the_other_intact():
    d = Driver(num_blocks=6, block_size=2)
    system = [7, 7, 8, 8]
    a = d.new_seq(system + [1, 2, 3])
    d.admit(a)
    b = d.new_seq(system + [4])
    assert d.admit(b) == d.bm.block_tables[a.seq_id][:2]
    shared = d.bm.block_tables[a.seq_id][:2]
    assert [d.bm.blocks[i].ref_cnt for i in shared] == [2, 2]
    d.free(b)  # preempt the newest: a keeps the shared blocks, no block goes to the free queue
    assert [d.bm.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert not set(shared) & set(d.bm.free_block_queue)
    for token in [50, 51, 52]:  # a keeps decoding over its shared prefix
        d.sample(a, token)
        assert d.extend(a, 1)
    cached = d.admit(b)  # re-admitted: hits the blocks a still holds, and recomputes the rest
    assert cached == shared
    ref_counts_match_tables(d.bm)


def test_lru_evicts_the_least_recently_freed_cached_block_first():
    d = Driver(num_blocks=4, block_size=2)
    a = d.new_seq([1, 2, 3, 4])
    d.admit(a)
    b = d.new_seq([5, 6, 7, 8])
    d.admit(b)
    d.free(a)
    d.free(b)
    assert len(d.bm.hash_to_block) == 4  # all four blocks free, and all four still cached
    # A freed prefix is reusable until evicted: a's prefix hits while it sits in the free queue.
    assert len(d.bm.match_prefix(d.new_seq([1, 2, 3, 4, 0]))) == 2
    c = d.new_seq([9, 9, 9])
    d.admit(c)  # needs 2 blocks: a's (freed first) are evicted, b's survive
    assert d.bm.match_prefix(d.new_seq([1, 2, 3, 4, 0])) == []
    assert len(d.bm.match_prefix(d.new_seq([5, 6, 7, 8, 0]))) == 2


def test_a_sequence_frees_its_tail_first_so_its_prefix_is_evicted_last():
    d = Driver(num_blocks=3, block_size=2)
    a = d.new_seq([1, 2, 3, 4, 5, 6])
    d.admit(a)
    d.free(a)
    d.admit(d.new_seq([9]))  # one block: the tail block [5, 6] goes
    assert len(d.bm.match_prefix(d.new_seq([1, 2, 3, 4, 5, 6, 0]))) == 2


def test_a_hit_refreshes_a_free_block_in_the_lru_order():
    d = Driver(num_blocks=4, block_size=2)
    a, b = d.new_seq([1, 2, 3]), d.new_seq([5, 6, 7])
    d.admit(a)
    d.admit(b)
    d.free(a)
    d.free(b)  # eviction order now: a's blocks, then b's
    a2 = d.new_seq([1, 2, 4])
    d.admit(a2)  # hits a's first block and takes one fresh block
    d.free(a2)  # a's first block is now the most recently freed
    d.admit(d.new_seq([9, 9, 9, 9]))  # two blocks: the least recently freed go first
    assert len(d.bm.match_prefix(d.new_seq([1, 2, 0]))) == 1


def test_hash_collision_never_reuses_another_prefix(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 0)  # everything collides
    d = Driver(num_blocks=8, block_size=2)
    a = d.new_seq([1, 2, 3])
    d.admit(a)
    assert list(d.bm.hash_to_block) == [0]
    b = d.new_seq([4, 5, 6])  # same hash as a's first block, other tokens
    assert d.admit(b) == []
    assert d.bm.num_hit_tokens == 0
    c = d.new_seq([1, 2, 9])  # same hash and same tokens: a real hit
    assert d.admit(c) == d.bm.block_tables[a.seq_id][:1]


def test_hash_collision_of_a_parent_never_reuses_its_child(monkeypatch):
    """Blocks [a] and [b] collide; a child computed after [b] must not be served after [a]."""
    real = bm_module.chain_hash
    colliding = {(None, (1, 1)), (None, (2, 2))}
    fake = lambda parent, tokens: 0 if (parent, tokens) in colliding else real(parent, tokens)  # noqa: E731
    monkeypatch.setattr(bm_module, "chain_hash", fake)
    d = Driver(num_blocks=8, block_size=2)
    d.admit(d.new_seq([1, 1, 0]))  # [1, 1] registered under hash 0
    d.admit(d.new_seq([2, 2, 3, 3, 0]))  # [2, 2] collides; its child [3, 3] follows it
    victim = d.new_seq([1, 1, 3, 3, 0])
    d.admit(victim)  # Driver.check_prefix: no slot may hold [2, 2, 3, 3]'s keys/values


def test_without_prefix_caching_nothing_is_shared():
    d = Driver(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = d.new_seq([1, 2, 3, 4, 5])
    d.admit(a)
    assert d.admit(d.new_seq([1, 2, 3, 4, 5])) == []
    assert d.bm.hash_to_block == {} and d.bm.num_hit_tokens == 0


def test_can_allocate_counts_cached_free_blocks_it_would_take():
    d = Driver(num_blocks=3, block_size=2)
    a = d.new_seq([1, 2, 3, 4, 5])
    d.admit(a)
    d.free(a)  # 3 free blocks, 2 of them cached as [1, 2], [3, 4]
    b = d.new_seq([1, 2, 3, 4, 6, 7, 8])  # hits 2 blocks, needs 2 more: only 1 left
    cached = d.bm.match_prefix(b)
    assert len(cached) == 2
    assert not d.bm.can_allocate(cached, b.num_tokens, watermark=0)
    assert d.bm.can_allocate(cached, 6, watermark=0)
    assert not d.bm.can_allocate(cached, 6, watermark=1)  # 1 block needed + 1 kept free > 1 left


# ---------------------------------------------------------------------------------------------
# Property test: random admissions, shared prefixes, chunked growth, preemption and frees

PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5,) * 11]
SMALL_VOCAB = st.integers(0, 3)  # few distinct tokens: generated text collides into shared blocks


class BlockManagerMachine(RuleBasedStateMachine):
    colliding_hash = False

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4, 7]),
                caching=st.booleans())  # fmt: skip
    def setup(self, num_blocks, block_size, caching):
        self.d = Driver(num_blocks, block_size, caching)
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.waiting: list[Sequence] = []
        self.done: list[Sequence] = []

    def _admit(self, seq: Sequence, chunk: int) -> None:
        if self.d.admit(seq, chunk) is None:
            self.waiting.append(seq)
        else:
            self.running.append(seq)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(SMALL_VOCAB, max_size=6),
          chunk=st.integers(1, 16))  # fmt: skip
    def add(self, prefix, suffix, chunk):
        tokens = list(prefix) + suffix or [0]
        self._admit(self.d.new_seq(tokens), chunk)

    @precondition(lambda self: self.running or self.done)
    @rule(data=st.data(), suffix=st.lists(SMALL_VOCAB, max_size=4), chunk=st.integers(1, 16))
    def fork_by_prefix(self, data, suffix, chunk):
        parent = data.draw(st.sampled_from(self.running + self.done))
        cut = data.draw(st.integers(1, parent.num_tokens))
        self._admit(self.d.new_seq(parent.token_ids[:cut] + suffix), chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_new=st.integers(1, 9), token=SMALL_VOCAB)
    def step(self, data, num_new, token):
        seq = data.draw(st.sampled_from(self.running))
        if seq.num_computed_tokens == seq.num_tokens:
            self.d.sample(seq, token)
        while not self.d.extend(seq, num_new):  # no room: preempt the newest, like the scheduler
            victim = self.running.pop()
            self.d.free(victim)
            self.waiting.insert(0, victim)
            if victim is seq:
                return

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.running))
        self.running.remove(seq)
        self.d.free(seq)
        self.done.append(seq)

    @precondition(lambda self: self.running)
    @rule()
    def preempt(self):
        victim = self.running.pop()
        self.d.free(victim)
        self.waiting.insert(0, victim)

    @precondition(lambda self: self.waiting)
    @rule(chunk=st.integers(1, 16))
    def readmit(self, chunk):
        seq = self.waiting.pop(0)
        self._admit(seq, chunk)

    @invariant()
    def consistent(self):
        if not hasattr(self, "d"):
            return
        bm = self.d.bm
        bm.check_invariants()
        self.d.check_cache()
        assert set(bm.block_tables) == {s.seq_id for s in self.running}
        for seq in self.running:
            assert len(bm.block_tables[seq.seq_id]) == -(-seq.num_computed_tokens // bm.block_size)
            self.d.check_own_prefix(seq)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_block_manager_machine_with_a_colliding_hash(monkeypatch):
    """Same machine, with a hash that collides every third block: no wrong reuse allowed."""
    real = bm_module.chain_hash
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: real(parent, tokens) % 3)
    machine = type("Colliding", (BlockManagerMachine,), {})
    test = machine.TestCase
    test.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
    test("runTest").runTest()
