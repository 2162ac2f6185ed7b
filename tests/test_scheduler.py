"""The scheduler on its own (pure Python, no model): token budget, chunked prefill, the
sequence cap, the preemption victim, and admission that cannot hang."""

from __future__ import annotations

import types

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.outputs import accumulate
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestRejected, Scheduler, SchedulerStuck
from engine.sequence import PENDING, Sequence

EOS = 2


def make(num_blocks: int = 65, **limits) -> Scheduler:
    cfg = EngineConfig(model="", **{"max_model_len": 64, "max_num_seqs": 4,
                                    "max_num_batched_tokens": 32, "block_size": 4,
                                    "num_blocks": num_blocks, **limits})
    blocks = BlockManager(cfg.total_blocks, cfg.block_size, enable_prefix_caching=False)
    return Scheduler(cfg, blocks, eos_token_ids=frozenset({EOS}))


def seq(n: int, max_tokens: int | None = 8, first: int = 10) -> Sequence:
    return Sequence(list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), 4)


def step(sched: Scheduler, token: int = 7):
    """One schedule + postprocess, sampling `token` wherever a step reaches a sequence's end."""
    out = sched.schedule()
    sched.postprocess(out, [[token] if e.samples else None for e in out.scheduled])
    return out


def test_prompts_are_chunked_to_the_token_budget():
    sched = make()
    a, b = seq(20), seq(20, first=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(e.seq, e.num_new_tokens, e.start) for e in out.scheduled] == [(a, 20, 0),
                                                                           (b, 12, 0)]
    assert out.num_tokens == 32
    assert [e.samples for e in out.scheduled] == [True, False]  # b's prompt is not done
    sched.postprocess(out, [[7], None])
    out = sched.schedule()
    # Running sequences first: a's decode token, then b's prompt, all but one token: 1 + 8
    # would pad to 16 rows, so 8 rows now and 2 (a's and b's last) next time.
    assert [(e.seq, e.num_new_tokens, e.start) for e in out.scheduled] == [(a, 1, 20),
                                                                           (b, 7, 12)]


def test_a_chunk_just_past_a_bucket_leaves_the_excess_to_the_next_step():
    sched = make(num_blocks=129, max_model_len=128, max_num_batched_tokens=64)
    running = [seq(4, max_tokens=50, first=100 * i) for i in range(3)]
    for s in running:
        sched.add(s)
    step(sched)  # their prompts; now three decodes
    sched.add(big := seq(30, first=900))
    out = sched.schedule()  # 3 decodes + 30 prompt tokens = 33: one past the 32 bucket
    assert [e.num_new_tokens for e in out.scheduled] == [1, 1, 1, 29]
    sched.postprocess(out, [[7], [7], [7], None])
    out = sched.schedule()  # 4 decodes' worth: the prompt's last token and 3 decodes
    assert out.num_tokens == 4 and out.scheduled[-1].seq is big
    # Far past a bucket, nothing moves: 3 decodes + 26 = 29 rows cost 32 + 4 as they are,
    # 16 + 32 cut to 16.
    sched2 = make(num_blocks=129, max_model_len=128, max_num_batched_tokens=64)
    for s in (seq(4, first=100 * i) for i in range(3)):
        sched2.add(s)
    step(sched2)
    sched2.add(seq(26, first=900))
    assert sched2.schedule().num_tokens == 29


def test_the_sequence_cap_holds_new_prompts_back():
    sched = make(max_num_seqs=2)
    seqs = [seq(3, first=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = step(sched)
    assert [e.seq for e in out.scheduled] == seqs[:2]
    assert list(sched.waiting) == [seqs[2]]


def test_preemption_takes_the_newest_running_sequence_and_requeues_it_first():
    # 16 usable blocks of 4 tokens; three 20-token prompts take 15 of them.
    sched = make(num_blocks=17, max_model_len=40)
    a, b, c = (seq(20, max_tokens=20, first=100 * i) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    step(sched)  # a and b's prompts (32 tokens)
    step(sched)  # c's prompt, a's decode and the rest of b's prompt: all 16 blocks held
    preempted = []
    while not preempted:
        preempted = step(sched).preempted
    assert preempted == [c]  # the newest running sequence
    assert sched.waiting[0] is c and c.block_table == [] and c.num_computed_tokens == 0
    assert sched.num_preemptions == 1


def test_a_cache_smaller_than_one_sequence_refuses_to_start():
    with pytest.raises(ValueError, match=r"holds 8 blocks of 4 tokens \(32 tokens\).*"
                                         r"max_model_len 64 tokens needs \(16 blocks\)"):
        make(num_blocks=9)


def test_a_request_without_max_tokens_runs_to_the_context_limit_without_hanging():
    # The cache holds exactly one max_model_len sequence; a request with no max_tokens
    # grows until the context is full and ends with "length": no self-preemption loop.
    sched = make(num_blocks=17)
    s = seq(5, max_tokens=None)
    sched.add(s)
    for _ in range(100):
        if not sched.has_unfinished():
            break
        step(sched)
    assert s.finish_reason == "length" and s.num_tokens == 64
    assert sched.num_preemptions == 0
    assert sched.blocks.num_free_blocks == sched.blocks.num_usable_blocks


def test_requests_that_cannot_fit_are_rejected_with_the_numbers():
    sched = make()
    with pytest.raises(RequestRejected, match="needs 60 prompt tokens \\+ max_tokens 8 = 68"):
        sched.add(seq(60))
    with pytest.raises(RequestRejected, match="prompt has 64 tokens"):
        sched.add(seq(64, max_tokens=None))
    with pytest.raises(RequestRejected, match="empty"):
        sched.check_fits(0, None)


def test_a_step_that_schedules_nothing_while_work_waits_is_an_error():
    sched = make()
    s = seq(4)
    sched.add(s)
    while sched.blocks.num_free_blocks:
        sched.blocks.allocate(seq(4, first=900))
    with pytest.raises(SchedulerStuck, match="1 waiting and 0 running.*0 of 64 KV blocks free"):
        sched.schedule()


def test_stop_conditions_respect_min_tokens():
    sched = make()
    s = Sequence([10, 11], SamplingParams(max_tokens=8, min_tokens=2), 4)
    sched.add(s)
    step(sched, token=EOS)  # EOS as the first output token: min_tokens keeps it going
    assert not s.is_finished
    step(sched, token=EOS)
    assert s.finish_reason == "stop" and s.output_token_ids == [EOS, EOS]


# ---- overlapped steps: booked at dispatch, read one step later ---------------------------


def test_an_overlapped_step_books_a_pending_token_and_resolves_it_later():
    sched = make()
    s = seq(4, max_tokens=3)
    sched.add(s)
    first = sched.schedule()                      # the prompt: samples token 0
    assert first.scheduled[0].samples and s.token_ids[-1] == PENDING
    assert s.num_computed_tokens == 4 and s.num_pending == 1
    second = sched.schedule()                     # dispatched before `first` is read
    assert [(e.start, e.num_new_tokens, e.samples) for e in second.scheduled] == [(4, 1, True)]
    assert s.num_pending == 2 and s.num_output_tokens == 2
    sched.postprocess(first, [[41]])
    assert s.token_ids[4:] == [41, PENDING] and s.output_token_ids == [41]
    third = sched.schedule()                      # token 2 is the last: nothing to schedule
    assert [e.num_new_tokens for e in third.scheduled] == [1]
    assert sched.schedule().scheduled == []       # max_tokens reached by pending tokens only
    sched.postprocess(second, [[42]])
    sched.postprocess(third, [[43]])
    assert s.finish_reason == "length" and s.output_token_ids == [41, 42, 43]
    assert sched.blocks.num_free_blocks == sched.blocks.num_usable_blocks


def test_a_stop_learnt_late_drops_the_pending_token_after_it():
    sched = make()
    s = seq(4, max_tokens=10)
    sched.add(s)
    first = sched.schedule()
    second = sched.schedule()                     # already computing the token after EOS
    sched.postprocess(first, [[EOS]])
    assert s.finish_reason == "stop" and s.token_ids == [10, 11, 12, 13, EOS]
    assert s.num_pending == 0 and sched.blocks.num_free_blocks == sched.blocks.num_usable_blocks
    sched.postprocess(second, [[99]])               # read later: ignored, never shown
    assert s.output_token_ids == [EOS]


def test_a_sequence_preempted_with_a_pending_token_waits_for_it():
    sched = make()
    s = seq(4, max_tokens=10)
    sched.add(s)
    first = sched.schedule()
    sched._preempt(sched.running.pop())           # as a full cache would, while first runs
    assert sched.schedule().scheduled == []       # no recompute of an unknown token
    sched.postprocess(first, [[55]])
    again = sched.schedule()
    assert again.scheduled[0].start == 0 and again.scheduled[0].num_new_tokens == 4
    assert s.token_ids == [10, 11, 12, 13, 55] and s.num_pending == 0  # 4 of 5: a bucket


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_on_and_off_agree_under_preemption_and_aborts(overlap):
    """With a fake runner (next token = last + 1) and a cache that forces preemption, both
    modes give the same outputs, preempt, and leave every block free."""
    from fakes import FakeRunner

    from engine.llm_engine import LLMEngine

    def run(async_scheduling: bool):
        cfg = EngineConfig(model="fake", max_model_len=64, max_num_seqs=6,
                           max_num_batched_tokens=32, block_size=4, num_blocks=33,
                           async_scheduling=async_scheduling)
        tokenizer = types.SimpleNamespace(eos_token_ids=frozenset({EOS}), vocab_size=10**6)
        eng = LLMEngine(cfg, runner=FakeRunner(), tokenizer=tokenizer, detokenize=False)
        ids = [eng.add_request([100 * i + j for j in range(3 + 5 * i)], SamplingParams(
            temperature=0, max_tokens=20 + 3 * i, ignore_eos=True)) for i in range(6)]
        outs, steps = {}, 0
        while eng.has_unfinished():
            steps += 1
            if steps == 7:
                outs[ids[2]] = accumulate(outs.get(ids[2]), eng.abort(ids[2]))
            for o in eng.step():  # (deltas: folded into each request's whole output)
                outs[o.request_id] = accumulate(outs.get(o.request_id), o)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
        eng.block_manager.check_invariants()
        return ({k: (o.outputs[0].token_ids, o.outputs[0].finish_reason)
                 for k, o in outs.items()}, eng.scheduler.num_preemptions)

    got, preemptions = run(overlap)
    want, _ = run(False)
    assert preemptions > 0
    assert {k: v for k, v in got.items() if k != "req-2"} == {
        k: v for k, v in want.items() if k != "req-2"}
    for k, (tokens, reason) in got.items():
        if k == "req-2":
            assert reason == "abort"
        else:
            first = 100 * int(k[4:]) + 2 + 5 * int(k[4:])  # the prompt's last id
            assert reason == "length" and tokens == list(range(first + 1, first + 1 + len(tokens)))


def _siblings(sched: Scheduler, n: int, prompt_len: int) -> list[Sequence]:
    params = SamplingParams(max_tokens=4, n=n)
    sibs = [Sequence(list(range(10, 10 + prompt_len)), params, 4, request_id="r")
            for _ in range(n)]
    for s in sibs:
        sched.add(s)
    return sibs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_siblings_of_one_request_compute_their_prompt_once(prefix_caching):
    """n = 3, a 22-token prompt (5 full blocks of 4 and 2 tokens): one sibling computes it,
    the other two wait until its blocks are cached, then hit its 5 blocks and compute 2
    tokens each (26 prompt tokens computed instead of 66). Without a prefix cache there is
    nothing to share: all three start at once."""
    sched = make()
    sched.blocks.enable_prefix_caching = prefix_caching
    a, b, c = _siblings(sched, 3, 22)
    out = step(sched)
    if not prefix_caching:  # b starts beside a, as far as the token budget goes
        assert [(e.seq, e.num_new_tokens) for e in out.scheduled] == [(a, 22), (b, 10)]
    else:
        while [e.seq for e in out.scheduled] == [a]:  # a's prompt, in chunks
            assert list(sched.waiting) == [b, c]
            out = step(sched)
        # Once a's 5 full blocks are cached, b and c start from them.
        assert [(e.seq, e.start, e.num_new_tokens) for e in out.scheduled][1:] == [
            (b, 20, 2), (c, 20, 2)]
        assert b.num_cached_tokens == c.num_cached_tokens == 20
    computed = sum(s.num_prompt_tokens - s.num_cached_tokens for s in (a, b, c))
    assert computed == (22 + 2 + 2 if prefix_caching else 3 * 22)
    while sched.has_unfinished():
        step(sched)
    assert [s.output_token_ids for s in (a, b, c)] == [[7] * 4] * 3
    assert sched.blocks.num_free_blocks == sched.blocks.num_usable_blocks


def test_a_sibling_never_waits_for_one_that_cannot_give_it_anything():
    """Siblings of a prompt shorter than a block (nothing to share) start together."""
    sched = make()
    sched.blocks.enable_prefix_caching = True
    a, b = _siblings(sched, 2, 3)
    assert [e.seq for e in step(sched).scheduled] == [a, b]
