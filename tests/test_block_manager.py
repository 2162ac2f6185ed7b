"""BlockManager: block accounting, prefix cache hits and their limits, eviction order, decode
growth, and a state machine checking that no sequence ever reads K/V that is not its own."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import engine.block_manager as block_manager
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def make_seq(tokens, salt=None) -> Sequence:
    seq = Sequence(list(tokens), SamplingParams(), block_size=BS)
    if salt is not None:
        seq.cache_salt = salt
    return seq


def admit(bm: BlockManager, tokens, salt=None, compute=True) -> Sequence:
    """Allocate a sequence and, like a finished prefill step, mark all its tokens computed."""
    seq = make_seq(tokens, salt)
    bm.allocate(seq)
    if compute:
        bm.mark_computed(seq, seq.num_tokens)
    bm.check_invariants()
    return seq


def test_allocate_and_deallocate_account_for_every_block():
    bm = BlockManager(num_blocks=10, block_size=BS)
    assert bm.num_usable_blocks == bm.num_free_blocks == 9 and bm.usage == 0.0
    a = admit(bm, range(10))                   # 3 blocks, the last one partial
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert bm.num_free_blocks == 6 and bm.usage == pytest.approx(3 / 9)
    assert a.num_cached_tokens == 0 and a.num_computed_tokens == 10
    bm.deallocate(a)
    assert bm.num_free_blocks == 9 and bm.usage == 0.0
    assert a.block_table == [] and a.num_computed_tokens == a.num_cached_tokens == 0
    bm.deallocate(a)                           # a second time is harmless
    bm.check_invariants([])
    assert bm.num_free_blocks == 9


def test_block_zero_is_never_handed_out_and_running_out_is_a_clear_error():
    bm = BlockManager(num_blocks=5, block_size=BS, enable_prefix_caching=False)
    seqs = [admit(bm, [i] * 4) for i in range(4)]
    assert sorted(b for s in seqs for b in s.block_table) == [1, 2, 3, 4]
    extra = make_seq([9])
    assert not bm.can_allocate(extra)
    with pytest.raises(RuntimeError, match="needs 1 free KV blocks, 0 free"):
        bm.allocate(extra)
    assert extra.block_table == []
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate(seqs[0])
    bm.check_invariants(seqs)


def test_second_sequence_reuses_the_shared_prefix_blocks():
    bm = BlockManager(num_blocks=20, block_size=BS)
    a = admit(bm, range(10))                   # full blocks [0..3], [4..7]
    b = admit(bm, [*range(8), 50, 51, 52], compute=False)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert bm._ref_counts[a.block_table[0]] == bm._ref_counts[a.block_table[1]] == 2
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (2 + 2, 2)
    assert bm.num_free_blocks == 20 - 1 - 3 - 1
    bm.check_invariants([a, b])


def test_no_hit_past_the_first_differing_block():
    bm = BlockManager(num_blocks=20, block_size=BS)
    a = admit(bm, range(12))
    b = admit(bm, [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11])   # same third block, other second
    assert b.block_table[0] == a.block_table[0]
    assert not set(b.block_table[1:]) & set(a.block_table)
    assert b.num_cached_tokens == 4 and bm.prefix_cache_hits == 1
    c = admit(bm, [99, *range(1, 12)])                      # differs in the first block
    assert not set(c.block_table) & set(a.block_table) and c.num_cached_tokens == 0
    bm.check_invariants([a, b, c])


def test_partial_last_block_is_never_shared():
    bm = BlockManager(num_blocks=20, block_size=BS)
    a = admit(bm, range(6))
    b = admit(bm, range(6))
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_cached_tokens == 4 and bm.num_cached_blocks == 1


def test_a_fully_cached_prompt_computes_its_last_block_privately():
    bm = BlockManager(num_blocks=4, block_size=BS)          # 3 usable blocks
    a = admit(bm, range(8))
    b = make_seq(range(8))
    assert bm.can_allocate(b)
    bm.allocate(b)
    # the last token must be computed; it lands in a block of b's own, never in a's
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_cached_tokens == b.num_computed_tokens == 4
    bm.mark_computed(b, 8)
    bm.check_invariants([a, b])
    assert bm.num_free_blocks == 0
    c = make_seq(range(8))
    assert not bm.can_allocate(c)                            # it would need a private block


def test_hash_collision_does_not_share_a_block(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, token_ids: b"same")
    bm = BlockManager(num_blocks=20, block_size=BS)
    a = admit(bm, [1, 2, 3, 4, 5])
    b = admit(bm, [5, 6, 7, 8, 9])
    assert not set(a.block_table) & set(b.block_table)
    assert b.num_cached_tokens == 0 and bm.prefix_cache_hits == 0
    c = admit(bm, [5, 6, 7, 8, 0])                           # equal tokens still hit
    assert c.block_table[:1] == b.block_table[:1]


def test_blocks_enter_the_cache_only_once_computed():
    bm = BlockManager(num_blocks=20, block_size=BS)
    a = admit(bm, range(12), compute=False)                  # allocated, K/V not written
    assert admit(bm, range(12), compute=False).num_cached_tokens == 0
    bm.mark_computed(a, 6)                                   # chunked prefill: 1.5 blocks
    c = admit(bm, range(12), compute=False)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    bm.mark_computed(a, 12)
    d = admit(bm, range(12), compute=False)                  # the last block stays private
    assert d.block_table[:2] == a.block_table[:2] and d.block_table[2] != a.block_table[2]


def test_least_recently_freed_cached_block_is_evicted_first():
    bm = BlockManager(num_blocks=3, block_size=BS)           # 2 usable blocks
    a = admit(bm, [1, 1, 1, 1])
    b = admit(bm, [2, 2, 2, 2])
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 2
    c = admit(bm, [3, 3, 3])                                 # one fresh block: evicts a's
    assert c.block_table == [1] and bm.num_cached_blocks == 1
    bm.deallocate(c)
    d = admit(bm, [2, 2, 2, 2, 5])                           # b's block survived
    assert d.num_cached_tokens == 4 and d.block_table[0] == 2
    bm.deallocate(d)
    e = admit(bm, [1, 1, 1, 1, 8])
    assert e.num_cached_tokens == 0


def test_uncached_free_blocks_are_handed_out_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=BS)           # 3 usable blocks
    x = admit(bm, [9] * 4)                                   # block 1, cached
    a = admit(bm, range(6))                                  # block 2 cached, block 3 partial
    bm.deallocate(x)
    bm.deallocate(a)                                         # frees its partial block last...
    assert admit(bm, [5]).block_table == [3]                 # ...but it is handed out first
    assert admit(bm, [9] * 4).block_table == [1]             # x's prefix survived


def test_a_freed_chain_is_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=BS)           # 3 usable blocks
    a = admit(bm, range(8))                                  # blocks 1, 2
    bm.deallocate(a)
    b = admit(bm, [9] * 5, compute=False)                    # two fresh blocks: 3, then a's tail
    assert b.block_table == [3, 2]
    bm.deallocate(b)
    assert admit(bm, range(8), compute=False).num_cached_tokens == 4


def test_a_duplicate_cached_copy_nobody_holds_is_handed_out_first():
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = admit(bm, [1, 2, 3, 4], compute=False)               # block 1
    b = admit(bm, [1, 2, 3, 4], compute=False)               # block 2: a is not computed yet
    bm.mark_computed(b, 4)
    bm.deallocate(b)                                         # block 2 cached, free
    bm.mark_computed(a, 4)                                   # the same content again, newer
    bm.check_invariants([a])
    assert bm.num_cached_blocks == 1
    assert admit(bm, [9]).block_table == [2]
    assert admit(bm, [1, 2, 3, 4, 5]).block_table[0] == 1


def test_hit_on_a_freed_cached_block_takes_it_off_the_free_list():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = admit(bm, range(9))
    cached = a.block_table[:2]
    bm.deallocate(a)
    assert bm.num_free_blocks == 9
    b = make_seq([*range(8), 42])
    bm.allocate(b)
    assert b.block_table[:2] == cached and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 6 and not set(cached) & set(bm._free)
    assert all(bm._ref_counts[blk] == 1 for blk in cached)
    bm.check_invariants([b])


def test_decode_grows_the_block_table_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=BS)           # 3 usable blocks
    seq = admit(bm, range(4))
    other = admit(bm, [7] * 4)
    for t in range(4):                                       # tokens 4..7 fill a second block
        seq.append_token(100 + t)                            # postprocess of the previous step
        assert bm.can_append(seq)                            # schedule of the next one
        bm.may_append(seq)
        assert len(seq.block_table) == 2 and bm.num_free_blocks == 0
        bm.mark_computed(seq, seq.num_tokens)                # the step wrote its K/V
    seq.append_token(200)                                    # token 8 needs a third block
    assert not bm.can_append(seq)
    with pytest.raises(RuntimeError, match="needs 1 free KV blocks, 0 free"):
        bm.may_append(seq)
    bm.deallocate(other)                                     # preempt the other sequence
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 3
    bm.check_invariants([seq])
    # The generated tokens are cached too once computed.
    assert len(bm._cache_hits(make_seq([*range(4), 100, 101, 102, 103, 9]))) == 2


def test_salts_isolate_tenants():
    bm = BlockManager(num_blocks=20, block_size=BS)
    admit(bm, range(9), salt="tenant-a")
    assert admit(bm, range(9), salt="tenant-b").num_cached_tokens == 0
    assert admit(bm, range(9)).num_cached_tokens == 0
    assert admit(bm, range(9), salt="tenant-a").num_cached_tokens == 8


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=20, block_size=BS, enable_prefix_caching=False)
    a = admit(bm, range(8))
    b = admit(bm, range(8))
    assert not set(a.block_table) & set(b.block_table)
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == bm.num_cached_blocks == 0


def test_can_allocate_counts_hits_on_free_blocks_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)           # 3 usable blocks
    a = admit(bm, range(8))
    bm.deallocate(a)                                         # blocks 1, 2 free but cached
    hold = admit(bm, [9])                                    # takes the uncached block 3
    assert hold.block_table == [3]
    before = (list(bm._free), list(bm._ref_counts), dict(bm._hash_to_block))
    assert bm.can_allocate(make_seq(range(8)))               # 2 hits, both off the free list
    assert not bm.can_allocate(make_seq([*range(8), 0]))     # ... plus one fresh block
    assert (list(bm._free), list(bm._ref_counts), dict(bm._hash_to_block)) == before
    assert bm.prefix_cache_queries == 2


def test_mark_computed_rejects_tokens_without_blocks():
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = admit(bm, range(5), compute=False)
    with pytest.raises(ValueError, match="6 computed tokens"):
        bm.mark_computed(seq, 6)
    seq.append_token(5)
    seq.append_token(6)
    seq.append_token(7)
    seq.append_token(8)                                      # needs a third block: not yet there
    with pytest.raises(ValueError):
        bm.mark_computed(seq, 9)


def _fill(bm: BlockManager, start: int) -> list[Sequence]:
    """Sequences of fresh content that together take every free block."""
    seqs = []
    while bm.num_free_blocks:
        seqs.append(admit(bm, range(start, start + BS)))
        start += BS
    return seqs


def test_a_session_keeps_its_blocks_past_other_traffic():
    for keep in (False, True):
        bm = BlockManager(num_blocks=12, block_size=BS)
        turn = admit(bm, range(100, 100 + 3 * BS))          # 3 full blocks
        bm.deallocate(turn, keep_for="resp_1" if keep else None)
        assert bm.num_kept_blocks == (3 if keep else 0)
        others = admit(bm, range(200, 200 + 8 * BS))        # the 8 other free blocks ...
        bm.deallocate(others)
        more = admit(bm, range(300, 300 + 8 * BS))          # ... then cached ones, again
        bm.deallocate(more)
        bm.check_invariants([])
        nxt = admit(bm, [*range(100, 100 + 3 * BS), 7], compute=False)
        assert nxt.num_cached_tokens == (3 * BS if keep else 0)


def test_kept_blocks_go_when_nothing_else_is_left_and_come_back_when_released():
    bm = BlockManager(num_blocks=6, block_size=BS)
    turn = admit(bm, range(2 * BS))
    bm.deallocate(turn, keep_for="s")
    held = _fill(bm, 500)                                   # 3 free blocks, then the 2 kept
    assert len(held) == 5 and bm.num_free_blocks == bm.num_kept_blocks == 0
    bm.check_invariants(held)
    for seq in held:
        bm.deallocate(seq)
    bm.release("s")                                         # nothing of it is left: harmless
    bm.check_invariants([])
    again = admit(bm, range(8 * BS, 10 * BS))
    bm.deallocate(again, keep_for="t")
    assert bm.num_kept_blocks == 2
    bm.release("t")
    assert bm.num_kept_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants([])


def test_two_sessions_keep_a_shared_prefix_until_both_are_released():
    bm = BlockManager(num_blocks=12, block_size=BS)
    a = admit(bm, [*range(2 * BS), 1])
    b = admit(bm, [*range(2 * BS), 2])
    bm.deallocate(a, keep_for="a")
    bm.deallocate(b, keep_for="b")
    assert bm.num_kept_blocks == 2                          # the shared blocks, once
    bm.release("a")
    assert bm.num_kept_blocks == 2
    bm.release("b")
    assert bm.num_kept_blocks == 0
    bm.check_invariants([])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, chunked prefill, decode, preemption, finishes (some kept by a
    session) and sessions released over overlapping prompts. A fake KV cache records, per
    physical slot, which (salt, prefix) its K/V belongs to; every computed token of every
    live sequence must read its own."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BS)
        self.seqs: list[Sequence] = []
        self.kv: dict[tuple[int, int], tuple] = {}
        self.ever_held: set[int] = set()

    def _key(self, seq, pos):
        return (getattr(seq, "cache_salt", None), tuple(seq.token_ids[:pos + 1]))

    @rule(stem=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 5)]),
          tail=st.lists(st.integers(0, 3), max_size=6), salt=st.sampled_from([None, None, "s"]))
    def admit(self, stem, tail, salt):
        seq = make_seq([*stem, *tail] or [0], salt)
        if not self.bm.can_allocate(seq):
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq)
            return
        free, queries, hits = self.bm.num_free_blocks, self.bm.prefix_cache_queries, \
            self.bm.prefix_cache_hits
        self.bm.allocate(seq)
        assert len(seq.block_table) == seq.num_blocks
        assert seq.num_cached_tokens == (self.bm.prefix_cache_hits - hits) * BS
        assert self.bm.prefix_cache_queries - queries == seq.num_tokens // BS
        assert seq.num_computed_tokens == seq.num_cached_tokens < seq.num_tokens
        assert free - self.bm.num_free_blocks <= seq.num_blocks
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def step(self, data, chunk):
        """One model step over a sequence: writes K/V of its next `chunk` uncomputed tokens."""
        seq = data.draw(st.sampled_from(self.seqs))
        start = seq.num_computed_tokens
        end = min(seq.num_tokens, start + chunk)
        for pos in range(start, end):
            self.kv[seq.block_table[pos // BS], pos % BS] = self._key(seq, pos)
        self.bm.mark_computed(seq, end)

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.seqs))
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(
            [s for s in self.seqs if s.num_computed_tokens == s.num_tokens]))
        seq.append_token(token)
        if self.bm.can_append(seq):
            self.bm.may_append(seq)
            assert len(seq.block_table) == seq.num_blocks
        else:
            assert self.bm.num_free_blocks == 0
            with pytest.raises(RuntimeError):
                self.bm.may_append(seq)
            self.finish_or_preempt(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), session=st.sampled_from([None, None, "a", "b"]))
    def finish(self, data, session):
        self.finish_or_preempt(data.draw(st.sampled_from(self.seqs)), session)

    @rule(session=st.sampled_from(["a", "b"]))
    def release(self, session):
        self.bm.release(session)

    def finish_or_preempt(self, seq, session=None):
        self.bm.deallocate(seq, keep_for=session)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        self.seqs.remove(seq)

    @invariant()
    def bookkeeping_is_consistent(self):
        self.bm.check_invariants(self.seqs)
        held = len({b for s in self.seqs for b in s.block_table})
        assert self.bm.num_free_blocks + held == self.bm.num_usable_blocks

    @invariant()
    def the_touched_blocks_are_exactly_those_ever_held(self):
        """Blocks 1..num_touched_blocks are every block ever handed out (the pool's memory on
        the CPU is resident only there)."""
        self.ever_held.update(b for s in self.seqs for b in s.block_table)
        assert self.ever_held == set(range(1, self.bm.num_touched_blocks + 1))

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        for seq in self.seqs:
            for pos in range(seq.num_computed_tokens):
                assert self.kv.get((seq.block_table[pos // BS], pos % BS)) == self._key(seq, pos)

    def teardown(self):
        for seq in list(self.seqs):
            self.finish_or_preempt(seq)
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                                 deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
