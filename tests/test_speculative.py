"""Speculative decoding by prompt lookup (engine/speculative.py): the proposer, the flag, and
the engine's drafting steps on a fake model whose outputs repeat, where every output can be
computed by hand. On the real model: tests/test_engine.py's speculative steps test."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from fakes import EqualCosts, FakeRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.draft_costs import StepCosts, choose_drafts
from engine.draft_model import DraftModel, check_vocabulary
from engine.llm_engine import LLMEngine
from engine.outputs import accumulate
from engine.sampling_params import SamplingParams
from engine.speculative import Drafter, SpeculativeConfig, accepted_length, may_match, propose

EOS = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1, "max_seqs": 8}


def test_prompt_lookup_takes_the_longest_suffix_at_its_latest_occurrence():
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # [2, 3] occurs at 1 and 5; [5, 2, 3] nowhere earlier: the latest [2, 3] is followed by 7, 8
    assert propose(ids, 3, 4, 1) == [7, 8, 5]
    assert propose(ids, 8, 4, 1) == [7, 8, 5, 2, 3]  # up to the end of the sequence
    assert propose([4, 5, 6], 3, 4, 1) == []          # nothing repeats
    assert propose([4, 5, 4], 2, 4, 2) == []          # only a 1-token match, min is 2
    assert propose([4, 5, 4], 2, 4, 1) == [5, 4]
    assert propose([7], 3, 4, 1) == []


def _lookup_by_definition(ids: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Prompt lookup as its docstring says it: for n from lookup_max down, the latest earlier
    window of n tokens equal to the last n; the k tokens after it."""
    for n in range(min(lookup_max, len(ids) - 1), lookup_min - 1, -1):
        hits = [i for i in range(len(ids) - n) if ids[i:i + n] == ids[len(ids) - n:]]
        if hits:
            return ids[hits[-1] + n:hits[-1] + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 8), st.integers(1, 6),
       st.integers(0, 5))
def test_prompt_lookup_is_its_definition(ids, k, lookup_max, less):
    lookup_min = max(1, lookup_max - less)
    assert propose(ids, k, lookup_max, lookup_min) == _lookup_by_definition(
        ids, k, lookup_max, lookup_min)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 6), st.integers(0, 5))
def test_a_match_is_possible_exactly_when_some_next_token_finds_one(ids, lookup_max, less):
    """may_match, checked while the step that samples the next token runs: true exactly
    when some next token gives prompt lookup a match."""
    lookup_min = max(1, lookup_max - less)
    some = any(propose(ids + [x], 1, lookup_max, lookup_min) for x in range(5))
    assert may_match(ids, lookup_min) == some


def test_the_flag_takes_vllms_keys_and_refuses_the_rest_clearly():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                  '"prompt_lookup_max": 5, "prompt_lookup_min": 2}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 2)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert EngineConfig(model="m", speculative=NGRAM).speculative == SpeculativeConfig(**NGRAM)
    for bad, words in [("{", "not JSON"), ("[1]", "JSON object"),
                       ('{"method": "eagle"}', "method must be one of"),
                       ('{"num_speculative_tokens": 0}', r"in \[1, 16\]"),
                       ('{"num_speculative_tokens": "4"}', "must be an integer"),
                       ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                       ('{"speculative_tokens": 3}', "unknown keys speculative_tokens"),
                       ('{"model": 3}', "model must be a non-empty string"),
                       ('{"method": "ngram", "model": "m"}', "prompt lookup takes no model"),
                       ('{"method": "draft_model"}', "a draft model is")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    plain = SpeculativeConfig.parse('{"method": "ngram"}')  # suffixes of 3 to 8 tokens
    assert (plain.prompt_lookup_max, plain.prompt_lookup_min) == (8, 3)
    short = SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_max": 2}')
    assert (short.prompt_lookup_max, short.prompt_lookup_min) == (2, 2)
    draft = SpeculativeConfig.parse('{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3}')
    assert (draft.method, draft.model, draft.num_speculative_tokens) == (
        "draft_model", "qwen2.5-coder-0.5b", 3)
    assert plain.looks_up and not draft.looks_up  # a draft model alone looks nothing up
    both = SpeculativeConfig.parse('{"model": "m", "prompt_lookup_max": 5}')
    assert (both.method, both.looks_up, both.prompt_lookup_max, both.prompt_lookup_min) == (
        "draft_model", True, 5, 3)
    low = SpeculativeConfig.parse('{"model": "m", "prompt_lookup_min": 2}')
    assert (low.looks_up, low.prompt_lookup_max, low.prompt_lookup_min) == (True, 8, 2)


def test_acceptance_and_backoff():
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_length([5], [4, 1]) == 0
    d = Drafter()
    assert d.ready(0)
    d.record(10, 3, 0)                      # all lost: wait 1, then 2, 4, ...
    assert not d.ready(10) and d.ready(11)
    d.record(11, 0, 0)
    assert not d.ready(12) and d.ready(13)
    d.record(13, 2, 1)                      # a gain resets the wait
    assert d.ready(13) and d.backoff == 1


class WrongDraft(FakeRunner):
    """A draft model that is the fake model but for the tokens it draws at positions that are
    a multiple of `every` (3, or 1: always wrong): last + 2 there."""

    def __init__(self, every: int = 3):
        super().__init__(modulus=10)
        self.rows = 0  # head rows drawn
        self.every = every

    def run(self, batch):
        result = super().run(batch)
        n = batch.num_rows
        self.rows += n
        at = batch.positions[batch.logits_indices[:n]] + 1
        ids = np.where(at % self.every == 0, (result.token_ids + 1) % 10, result.token_ids)
        self.last[batch.sampling["slots"][:n]] = ids  # what a later step's pending row reads
        return dataclasses.replace(result, token_ids=ids.astype(np.int32))


class CheckedDraftModel(DraftModel):
    """A DraftModel whose every step's page tables are checked against its sequences' own
    (the draft's K/V goes where the target's pages are, also after preemption), and whose
    drawings start where the draft's K/V stops being of the sequence's tokens: every token a
    drawing's first round counts as computed is the token the draft was fed there (never a
    draft the target rejected since)."""

    def __init__(self, *args):
        super().__init__(*args)
        build, self.tables_checked = self.input_batch.build, 0
        self.fed: dict[int, dict[int, int]] = {}  # seq_id -> position -> token fed there
        self._chunks = []
        self.firsts_checked = 0
        self.drawn = 0  # drafting entries whose drafts it drew (not prompt lookup's)

        def checked(out, seeds):
            batch = build(out, seeds)
            for i, e in enumerate(out.scheduled):
                table = e.seq.block_table
                assert list(batch.page_tables[i, :len(table)]) == table
                self.tables_checked += 1
            return batch
        self.input_batch.build = checked

    def _submit(self, chunks, entries, j, seeds, grammar):
        if j == 0:
            for c in chunks:
                fed = self.fed.get(c.seq.seq_id, {})
                assert all(fed.get(p) == c.seq.token_ids[p] for p in range(c.start)), c.seq
                self.firsts_checked += c.start > 0
        self._chunks.extend(chunks)
        return super()._submit(chunks, entries, j, seeds, grammar)

    def draw(self, out, *args, **kwargs):
        self.drawn += sum(1 for e in out.scheduled if e.drafts and not e.looked_up)
        super().draw(out, *args, **kwargs)
        for c in self._chunks:  # the tokens fed, the drafts among them drawn by now
            self.fed.setdefault(c.seq.seq_id, {}).update(
                (p, c.seq.token_ids[p]) for p in range(c.start, c.end))
        self._chunks.clear()


def _run(speculative, overlap=True, num_blocks=41, abort_at=None, draft=None, catch_up=None,
         target=None, **params):
    """Six requests through an engine on a fake model with next = (last + 1) % 10, whose
    prompts repeat that cycle in part (drafts from the prompt are kept for a while, then
    rejected); returns each request's (tokens, finish reason), the engine's speculation
    counters and preemptions. `draft`: a draft model's fake runner; `catch_up`: its steps'
    seconds per token bucket, for a draft model beside prompt lookup (StepCosts.draft_steps);
    `target`: another runner for the model."""
    cfg = EngineConfig(model="fake", max_model_len=64, max_num_seqs=12,
                       max_num_batched_tokens=32, block_size=4, num_blocks=num_blocks,
                       async_scheduling=overlap, speculative=speculative)
    tokenizer = types.SimpleNamespace(eos_token_ids=frozenset({EOS}), vocab_size=10**6)
    drafter = None if draft is None else CheckedDraftModel(
        dataclasses.replace(cfg, speculative=None), draft, tokenizer.eos_token_ids)
    if draft is not None:
        draft.checked = drafter  # (for the test to read what the draft model drew)
    eng = LLMEngine(cfg, runner=target or FakeRunner(modulus=10), tokenizer=tokenizer,
                    detokenize=False, draft=drafter)
    eng.scheduler.drafting.step_costs = EqualCosts()
    if catch_up is not None:
        eng.scheduler.drafting.step_costs.draft_steps = catch_up
        eng.scheduler.drafting.draft_behind = drafter.behind
    prompts = [[3, 4, 5, 9, 9, 0, 1, 3, 4], [5, 6, 7, 8, 9, 0, 1, 5, 6, 7],
               [1, 3, 4, 5, 6, 7, 1, 3], [0, 1, 2, 3, 4, 5], [8, 9, 8, 9], [6, 7, 8, 6, 7, 8, 6]]
    base = dict(temperature=0, ignore_eos=True) | params
    ids = [eng.add_request(p, SamplingParams(max_tokens=20 + 3 * i, **base))
           for i, p in enumerate(prompts)]
    outs, steps = {}, 0
    while eng.has_unfinished():
        steps += 1
        if steps == abort_at:
            outs[ids[2]] = accumulate(outs.get(ids[2]), eng.abort(ids[2]))
        for o in eng.step():
            outs[o.request_id] = accumulate(outs.get(o.request_id), o)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
    eng.block_manager.check_invariants()
    return ({k: (o.outputs[0].token_ids, o.outputs[0].finish_reason) for k, o in outs.items()},
            eng.scheduler.drafting.stats, eng.scheduler.num_preemptions, steps)


@pytest.mark.parametrize("overlap", [True, False])
def test_drafting_gives_the_same_tokens_in_fewer_steps(overlap):
    want, _, _, plain_steps = _run(None, overlap)
    got, stats, _, steps = _run(NGRAM, overlap)
    assert got == want
    for tokens, reason in got.values():  # the fake model's own tokens, to the last
        assert reason == "length"
        assert all(b == (a + 1) % 10 for a, b in zip(tokens[:-1], tokens[1:], strict=True))
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some kept, some rejected
    assert steps < plain_steps


def test_drafting_under_preemption_and_aborts_leaves_every_page_free():
    """A cache too small for all six (preemption by recompute) and an abort mid-run: the same
    outputs as without drafting; _run checks every block is free and the cache consistent."""
    want, _, _, _ = _run(None, num_blocks=17, abort_at=5)
    got, stats, preemptions, _ = _run(NGRAM, num_blocks=17, abort_at=5)
    assert preemptions > 0 and stats.num_accepted_tokens > 0
    aborted, _ = got.pop("req-2")  # (drafting reaches further by the same step)
    assert got == {k: v for k, v in want.items() if k != "req-2"}
    assert want["req-2"][1] == "abort" and aborted == [(4 + i) % 10 for i in range(len(aborted))]


def test_stops_inside_the_kept_drafts_end_the_sequence_there():
    """EOS (2) is among the drafts the model confirms: the sequence ends at it, as without
    drafting, and nothing past it is shown; a stop token id and max_tokens likewise."""
    for params in [dict(ignore_eos=False), dict(stop_token_ids=[7]), dict(min_tokens=4)]:
        want, _, _, _ = _run(None, **params)
        got, stats, _, _ = _run(NGRAM, **params)
        assert got == want and stats.num_accepted_tokens > 0, params
    got, _, _, _ = _run(NGRAM, ignore_eos=False)
    assert all(reason == "stop" and tokens[-1] == EOS for tokens, reason in got.values())


def test_text_that_repeats_nothing_keeps_its_steps_overlapped():
    """Prompt lookup with suffixes of 3 or more: while a sequence's tokens hold no repeated
    pair, no match can follow, so its steps stay overlapped (the engine never waits for a
    token to look up nothing); once its text repeats it drafts, and its tokens are the same."""
    cfg = EngineConfig(model="fake", max_model_len=128, max_num_seqs=4,
                       max_num_batched_tokens=32, block_size=4, num_blocks=64,
                       speculative={"method": "ngram", "num_speculative_tokens": 4})
    tokenizer = types.SimpleNamespace(eos_token_ids=frozenset({EOS}), vocab_size=10**6)
    outs = {}
    for spec in (None, cfg.speculative):
        eng = LLMEngine(dataclasses.replace(cfg, speculative=spec), runner=FakeRunner(modulus=40),
                        tokenizer=tokenizer, detokenize=False)
        drafting = eng.scheduler.drafting
        drafting.step_costs = EqualCosts()
        asked = []  # (outputs so far, whether the step may draft)
        may_speculate = eng.scheduler.may_speculate

        def spy(may_speculate=may_speculate, eng=eng, asked=asked):
            seqs = eng.scheduler.running
            asked.append((seqs[0].num_output_tokens if seqs else -1, may_speculate()))
            return asked[-1][1]

        eng.scheduler.may_speculate = spy
        req = eng.add_request([3], SamplingParams(max_tokens=70, temperature=0, ignore_eos=True))
        out = None
        while eng.has_unfinished():
            for o in eng.step():
                out = accumulate(out, o)
        outs[spec is None] = out.outputs[0].token_ids
        if spec is not None:  # 4, 5, ..., 39, 0, 1, 2, 3, 4: the first repeated pair at 38
            assert not any(may for n, may in asked if 0 <= n < 37), req
            assert any(may for n, may in asked if n >= 38)
            assert drafting.stats.num_accepted_tokens > 0
    assert outs[True] == outs[False] == [(3 + i) % 40 for i in range(1, 71)]


def test_a_large_batch_does_not_draft():
    """More running sequences than the limit: no step drafts (overlap is kept)."""
    got, stats, _, _ = _run({**NGRAM, "max_seqs": 2})
    want, _, _, _ = _run(None)
    assert got == want
    few, _, _, _ = _run({**NGRAM, "max_seqs": 1})
    assert few == want
    _, none, _, _ = _run({**NGRAM, "max_seqs": 1})
    assert stats.num_drafts > none.num_drafts


def test_a_dead_engine_reboots_and_drafts_again(tokenizer):
    """The step after a drafting one fails: the request in flight fails with the engine's
    error, the engine thread builds a new engine, and that one drafts (and keeps drafts) for
    the next request, whose tokens are the fake model's own."""
    import asyncio

    from fakes import wait_until

    from engine.async_engine import AsyncEngine, EngineDeadError

    faults = [3]  # the first engine's 4th step fails, once

    class FailsOnce(FakeRunner):
        def run(self, batch):
            if faults and self.calls == faults[0]:
                self.fail_next = bool(faults.pop())
            return super().run(batch)

    cfg = EngineConfig(model="fake", name="spec", max_model_len=64, max_num_seqs=8,
                       max_num_batched_tokens=32, speculative=NGRAM)
    engines = []

    def factory(c):
        engines.append(LLMEngine(c, runner=FailsOnce(modulus=10), tokenizer=tokenizer))
        engines[-1].scheduler.drafting.step_costs = EqualCosts()
        return engines[-1]

    engine = AsyncEngine(cfg, factory)
    prompt = [3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def run():
        return [o async for o in engine.generate(prompt, params)]

    try:
        with pytest.raises(EngineDeadError, match="injected fault"):
            asyncio.run(run())
        assert engines[0].scheduler.drafting.stats.num_accepted_tokens > 0  # it drafted first
        assert wait_until(lambda: engine.alive and len(engines) == 2)
        total = None
        for out in asyncio.run(run()):
            total = accumulate(total, out)
        assert total.outputs[0].token_ids == [(5 + i) % 10 for i in range(20)]
        assert engines[1].scheduler.drafting.stats.num_accepted_tokens > 0
        assert engine.num_restarts == 1
    finally:
        engine.shutdown()


def test_the_server_takes_the_flag_and_counts_drafts_in_metrics(tokenizer):
    """A fake engine with drafting behind the HTTP server: a completion whose prompt repeats
    gets the same tokens as the fake model's own, and /metrics counts drafted and kept tokens
    (vLLM's spec_decode names). A bad --speculative-config stops the server at start."""
    import httpx
    from fakes import serving

    from engine.async_engine import AsyncEngine, Engines
    from server import cli

    cfg = EngineConfig(model="fake", name="fake", max_model_len=128, max_num_seqs=8,
                       max_num_batched_tokens=32, speculative=NGRAM)
    engine = AsyncEngine(cfg, lambda c: LLMEngine(c, runner=FakeRunner(modulus=10),
                                                  tokenizer=tokenizer))
    try:
        with serving(Engines({"fake": engine})) as url:
            body = {"model": "fake", "prompt": [5, 6, 7, 8, 9, 3, 4, 5, 6, 7], "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 24
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        engine.shutdown()
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("xlaserve:spec_decode")}
    assert counts["xlaserve:spec_decode_num_draft_tokens_total"] >= counts[
        "xlaserve:spec_decode_num_accepted_tokens_total"] > 0
    assert counts["xlaserve:spec_decode_num_drafts_total"] > 0
    assert cli.main(["--speculative-config", '{"method": "eagle"}']) == 2


def test_drafts_fill_a_bucket_and_rejected_ones_give_their_pages_back():
    """One sequence, k = 4: its step brings 4 tokens (3 drafts), not 5 padded to 8. Drafts the
    model rejects are rolled back: the sequence keeps what was kept plus the sampled token,
    its pages cover exactly those, and no block past the verified tokens is cached."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    cfg = EngineConfig(model="", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
                       block_size=4, num_blocks=40, speculative=NGRAM)
    blocks = BlockManager(cfg.total_blocks, cfg.block_size)
    sched = Scheduler(cfg, blocks, eos_token_ids=frozenset({EOS}))
    s = Sequence([*range(10, 25), 10], SamplingParams(max_tokens=20), 4)  # 16 tokens
    sched.add(s)
    for token in (11, 12):                                   # the prompt, then a plain decode
        sched.postprocess(sched.schedule(), [[token]])
    assert s.token_ids[-3:] == [10, 11, 12] and s.num_computed_tokens == 17
    out = sched.schedule(speculate=True)                     # [10, 11, 12] -> 13, 14, 15, 16
    (entry,) = out.scheduled
    assert entry.drafts == [13, 14, 15] and entry.num_new_tokens == 4 and out.num_rows == 4
    assert len(s.block_table) == 6                           # 21 tokens: the drafts' block too
    sched.postprocess(out, [[13, 99, 5, 6]])                 # keeps 13, then samples 99
    assert s.token_ids[16:] == [11, 12, 13, 99] and entry.new_tokens == [13, 99]
    assert s.num_computed_tokens == 19 and s.num_pending == 0
    assert len(s.block_table) == 5                           # 20 tokens: the 6th block is free
    blocks.check_invariants([s])
    assert blocks.num_cached_blocks_of(s) == 4               # 19 computed: 4 full blocks
    stats = sched.drafting.stats
    assert stats.num_draft_tokens == 3 and stats.num_accepted_tokens == 1


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_cost_model_learns_each_step_from_the_result_before_it(overlap, method,
                                                                   monkeypatch):
    """On a clock the test moves: the host's scheduling takes 0.5 ms a step, the device 2 ms
    plus 1 ms a token of the step's bucket (the clock moves while the host waits for a
    result). Every step the cost model learns (all but a busy spell's first) cost exactly
    both, drafting or not, and an idle minute between two requests is in none of them; with
    overlap, a step read in the call after the one that scheduled it cost its device time
    alone (its host work was done before the previous result). A draft model's steps (10 ms
    plus 3 ms a token) are in none of the target's: a drafting round of a token a sequence
    is learnt apart, and a sequence's first round, which writes the draft's K/V for its
    whole prompt, in neither."""
    import engine.llm_engine

    clock = [0.0]
    monkeypatch.setattr(engine.llm_engine.time, "perf_counter", lambda: clock[0])

    class Timed:
        def __init__(self, result, seconds):
            self._result, self._seconds = result, seconds

        def result(self):  # the device's time passes while the host waits for it
            clock[0] += self._seconds
            return self._result

    class TimedRunner(FakeRunner):
        def submit(self, batch):
            return Timed(self.run(batch), 0.002 + 0.001 * batch.bucket[0])

    class Recorded(EqualCosts):
        def __init__(self):
            super().__init__()
            self.seen, self.rounds = [], []

        def record(self, bucket, seconds):
            self.seen.append((bucket, seconds))

        def record_round(self, seconds):
            self.rounds.append(seconds)

    class DraftRunner(FakeRunner):
        def submit(self, batch):
            return Timed(self.run(batch), 0.010 + 0.003 * batch.bucket[0])

    spec = NGRAM if method == "ngram" else DRAFTING
    cfg = EngineConfig(model="fake", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
                       async_scheduling=overlap, speculative=spec)
    tokenizer = types.SimpleNamespace(eos_token_ids=frozenset({EOS}), vocab_size=10**6)
    draft = None if method == "ngram" else DraftModel(
        dataclasses.replace(cfg, speculative=None), DraftRunner(modulus=10),
        tokenizer.eos_token_ids)
    eng = LLMEngine(cfg, runner=TimedRunner(modulus=10), tokenizer=tokenizer, detokenize=False,
                    draft=draft)
    costs = eng.scheduler.drafting.step_costs = Recorded()
    schedule = eng.scheduler.schedule

    def scheduling(*args):
        clock[0] += 0.0005
        return schedule(*args)

    eng.scheduler.schedule = scheduling
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in ([3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3], [6, 7, 8, 9, 0, 1, 2, 3, 4]):
        eng.generate([prompt], [params])
        clock[0] += 60.0  # idle
    buckets = {b for b, _ in costs.seen}
    if method == "ngram":  # plain steps and drafting ones
        assert 1 in buckets and len(buckets) > 1
    else:  # a draft model always right: every step but the prompt's drafts
        assert buckets - {1}
    assert eng.scheduler.drafting.stats.num_accepted_tokens > 0
    for bucket, seconds in costs.seen:
        device = 0.002 + 0.001 * bucket
        assert (seconds == pytest.approx(device + 0.0005)
                or overlap and seconds == pytest.approx(device)), (bucket, seconds)
    assert len(costs.seen) >= 2 * 24 / 4  # (each request's steps but its first)
    if method == "draft_model":  # one sequence: rounds of a token or two (buckets 1, 2)
        assert len(costs.rounds) >= 2 * 24 / 4
        for seconds in costs.rounds:
            assert seconds in (pytest.approx(0.013), pytest.approx(0.016)), seconds


def test_drafts_are_as_many_as_pay_for_their_step():
    """The cost model: where a step of 4 tokens costs what one does (an accelerator at batch
    1), a decode drafts in full; where it costs 2.2 times one (the 2-core CPU), only with a
    high acceptance; never where each token costs a step of its own."""
    bucket = lambda n: 1 << (n - 1).bit_length()
    flat = StepCosts({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.1})
    cpu = StepCosts({1: 10.0, 2: 14.0, 4: 22.0, 8: 40.0})
    linear = StepCosts({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})
    assert choose_drafts(0.7, 3, 0, 0.0, bucket, flat) == 3
    assert choose_drafts(0.9, 3, 0, 0.0, bucket, cpu) == 3
    assert choose_drafts(0.3, 3, 0, 0.0, bucket, cpu) == 0
    assert choose_drafts(0.99, 7, 0, 0.0, bucket, linear) == 0
    assert choose_drafts(0.7, 3, 0, 0.0, bucket, StepCosts()) == 3  # nothing timed: try


def test_a_new_sequence_drafts_from_the_acceptance_seen_lately():
    """A sequence's first drafts are as many as the acceptance the sequences before it met
    pays for: with the step costs of a 2-core CPU verifying a draft model's drafts, one
    draft at the 0.7 assumed before any evidence, three after drafts were kept throughout."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    cfg = EngineConfig(model="", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
                       block_size=4, num_blocks=40, speculative=NGRAM)
    sched = Scheduler(cfg, BlockManager(cfg.total_blocks, cfg.block_size),
                      eos_token_ids=frozenset({EOS}))
    sched.drafting.step_costs = StepCosts({1: 0.094, 2: 0.110, 4: 0.148, 8: 0.151})
    sched.drafting.step_costs.draft_round = 0.033  # (each draft costs a round, as a draft model's)

    def first_drafts() -> int:
        s = Sequence([*range(10, 25), 10], SamplingParams(max_tokens=20), 4)
        sched.add(s)
        sched.postprocess(sched.schedule(), [[11]])  # the prompt: [10, 11] -> 12, 13, 14
        out = sched.schedule(speculate=True)
        (entry,) = out.scheduled
        drafts = len(entry.drafts)
        sched.postprocess(out, [[*entry.drafts, 99]])
        sched.finish(s, "abort")
        return drafts

    assert sched.drafting.stats.recent_acceptance == Drafter.acceptance == 0.7
    assert first_drafts() == 1
    for _ in range(30):
        sched.drafting.stats.record(3, 3)
    assert sched.drafting.stats.recent_acceptance > 0.95
    assert first_drafts() == 3


@pytest.mark.slow
@pytest.mark.parametrize("pair,kv", [("ngram-default-model", "float32"),
                                     ("qwen2.5-coder-0.5b-for-1.5b", "float32"),
                                     ("ngram-default-model", "auto"),
                                     ("qwen2.5-coder-0.5b-for-1.5b", "auto"),
                                     ("lookup-then-0.5b-for-1.5b", "float32")])
def test_greedy_with_drafting_is_the_greedy_without(pair, kv):
    """64 prompts (the edits and quoted summaries of tests/data/grounded_prompts.jsonl, and
    short ones), 256 greedy tokens each, with and without drafting, every step allowed to
    draft: prompt lookup on the default model, 8 at a time, and Qwen2.5-Coder-0.5B drafting 3
    tokens for the 1.5B (both int4), 2 at a time (tens of minutes on a 2-core CPU), and the
    0.5B beside prompt lookup (the model's drafts where lookup finds none). With
    float32 KV pages the tokens are identical. With the default KV dtype (float16 pages) a
    verified chunk's attention may round differently from a lone decode's, so a sequence may
    differ only at a near-tie as models.parity defines it: at its first differing token, the
    drafting run's token is the plain run's runner-up there, within GAP_TOLERANCE of its top
    logit. The head has max_num_seqs rows, one per sequence and one per draft, so
    max_num_seqs leaves room for every draft of the sequences at once."""
    import collections
    import dataclasses
    import json
    from pathlib import Path

    from models.chat_template import ChatTemplate
    from models.known_models import fetch_default_model, fetch_model
    from models.parity import GAP_TOLERANCE

    if pair.startswith("ngram"):
        model, extra, at_once, rows = fetch_default_model(quiet=True), {}, 8, 16
        spec = {**NGRAM, "max_seqs": at_once}
    else:
        model, extra, at_once, rows = (fetch_model("qwen2.5-coder-1.5b", quiet=True),
                                       {"quantization": "int4"}, 2, 8)
        spec = {"model": str(fetch_model("qwen2.5-coder-0.5b", quiet=True)),
                "num_speculative_tokens": 3, "max_seqs": at_once}
        if pair.startswith("lookup"):
            spec["prompt_lookup_max"] = 8
    cfg = EngineConfig(model=str(model), kv_cache_dtype=kv, max_model_len=1024,
                       max_num_seqs=rows, max_num_batched_tokens=128, **extra)
    plain = LLMEngine(cfg)
    plain.runner.warmup()
    template = ChatTemplate.for_tokenizer(plain.tokenizer)
    lines = [json.loads(line) for line in (Path(__file__).parent / "data" /
                                           "grounded_prompts.jsonl").read_text().splitlines()]
    prompts = [plain.encode(template.render(line["messages"], add_generation_prompt=True),
                            add_special_tokens=False) for line in lines]
    prompts += [plain.encode(f"Count from {i} to {i + 40}, then back down:")
                for i in range(64 - len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True,
                            logprobs=None if kv == "float32" else 2)
    drafting = LLMEngine(dataclasses.replace(cfg, speculative=spec),
                         runner=plain.runner, tokenizer=plain.tokenizer)
    if drafting.draft is not None:
        drafting.draft.warmup()  # its executables (the target's are warm)
    drafting.scheduler.drafting.step_costs = EqualCosts()
    kinds = collections.Counter()  # drafting steps by whether prompt lookup drafted
    verify = drafting.scheduler.drafting.verify

    def counted(entry, rows):
        kinds[entry.looked_up] += 1
        return verify(entry, rows)

    drafting.scheduler.drafting.verify = counted
    got = {}
    for eng in (plain, drafting):
        got[eng is drafting] = [o.outputs[0] for i in range(0, 64, at_once)
                                for o in eng.generate(prompts[i:i + at_once], params)]
    stats = drafting.scheduler.drafting.stats
    assert stats.num_accepted_tokens > 1000, stats
    if pair.startswith("lookup"):  # steps with each kind's drafts
        assert kinds[True] > 0 and kinds[False] > 0, kinds
    if kv == "float32":
        assert [c.token_ids for c in got[True]] == [c.token_ids for c in got[False]]
        return
    for ours, ref in zip(got[True], got[False], strict=True):
        at = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids, strict=True))
                   if a != b), None)
        if at is None:
            continue
        (best, top1), (second, top2) = ref.logprobs[at].top[:2]
        assert best == ref.token_ids[at] and second == ours.token_ids[at], (at, ref.logprobs[at])
        assert top1 - top2 < GAP_TOLERANCE, (at, top1 - top2)


def test_a_table_cut_by_rejected_drafts_and_grown_again_reaches_the_batch():
    """Rejected drafts give a page back; another sequence takes it, and the first grows again
    with a new page at the same index: the step's page table is the sequence's new one."""
    from engine.batch import InputBatch
    from engine.block_manager import BlockManager
    from engine.scheduler import ScheduledSeq, SchedulerOutput
    from engine.sequence import Sequence, SequenceStatus

    cfg = EngineConfig(model="", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                       block_size=4, num_blocks=20)
    blocks, batch = BlockManager(cfg.total_blocks, 4), InputBatch(cfg)
    a = Sequence(list(range(10, 18)), SamplingParams(max_tokens=20), 4)  # 2 blocks
    blocks.allocate(a)
    a.status = SequenceStatus.RUNNING
    step = lambda seq: batch.build(SchedulerOutput([ScheduledSeq(seq, 1, seq.num_tokens - 1,
                                                                 samples=True)], []), {})
    a.token_ids += [1, 2, 3]                      # drafts into a third block
    blocks.may_append(a)
    step(a)
    third = a.block_table[2]
    del a.token_ids[-3:]
    blocks.trim(a)                                # rejected: the third block is free again
    b = Sequence([5, 6, 7], SamplingParams(max_tokens=4), 4)
    blocks.allocate(b)                            # ... and b takes it
    assert b.block_table == [third]
    a.token_ids += [4, 5]                         # a grows into a third block again
    blocks.may_append(a)
    assert a.block_table[2] != third
    built = step(a)
    assert list(built.page_tables[0, :3]) == a.block_table


DRAFTING = {"model": "fake-draft", "num_speculative_tokens": 4, "max_seqs": 8}


@pytest.mark.parametrize("overlap", [True, False])
def test_a_draft_model_gives_the_same_tokens_in_fewer_steps(overlap):
    """A draft model (engine/draft_model.py) that is right but at every third position: the
    target's tokens, to the last; the rejected drafts' pages freed (_run checks)."""
    want, _, _, plain_steps = _run(None, overlap)
    right, stats, _, steps = _run(DRAFTING, overlap, draft=FakeRunner(modulus=10))
    assert right == want and steps < plain_steps
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # every draft kept
    wrong = WrongDraft()
    got, stats, _, _ = _run(DRAFTING, overlap, draft=wrong)
    assert got == want and wrong.rows > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_draft_model_that_loses_its_drafts_draws_again_from_the_kept_tokens():
    """Drafts that always lose: each sequence waits longer and longer between drawings, with
    plain steps between; each drawing starts where the draft's K/V stops being of the
    sequence's tokens (CheckedDraftModel), never past the rejected drafts it wrote."""
    want, _, _, _ = _run(None)
    wrong = WrongDraft(every=1)
    got, stats, _, _ = _run(DRAFTING, draft=wrong)
    assert got == want and stats.num_drafts > 6 and stats.num_accepted_tokens == 0


def test_prompt_lookup_beside_a_draft_model_leaves_it_where_the_lookup_finds_nothing():
    """A draft model given prompt_lookup_max/_min: each drafting step takes prompt lookup's
    drafts where it finds some, the model's where it finds none or lost its last (no waiting
    between): the target's tokens, some drafts of each kind, and fewer of the draft model's
    rows than with the model alone; its drawings start from its own K/V, past the tokens
    prompt lookup drafted (CheckedDraftModel)."""
    want, _, _, _ = _run(None)
    alone, both = WrongDraft(), WrongDraft()
    _run(DRAFTING, draft=alone)
    lookup = DRAFTING | {"prompt_lookup_max": 4, "prompt_lookup_min": 1}
    got, stats, _, _ = _run(lookup, draft=both)
    assert got == want and 0 < both.rows < alone.rows
    drawn = both.checked.drawn
    assert 0 < drawn < stats.num_drafts and both.checked.firsts_checked > 0


def test_a_draft_models_catching_up_counts_against_its_drafts():
    """Beside prompt lookup, a draft model's drafts pay for its first round over the tokens
    lookup's steps brought (StepCosts.catch_up: beyond a round of a token or two, in
    proportion past the timed buckets): drafts that pay alone do not with a long catch-up."""
    costs = StepCosts({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0})
    costs.draft_round = 0.3
    bucket = lambda n: next(b for b in (1, 2, 4, 8, 16, 32) if b >= n)  # noqa: E731
    assert costs.catch_up(40, bucket) == 0.0  # no draft steps timed: nothing known
    costs.draft_steps = {1: 0.3, 2: 0.35, 4: 0.5, 8: 0.9}
    assert costs.catch_up(2, bucket) == 0.0 and costs.catch_up(3, bucket) == pytest.approx(0.15)
    assert costs.catch_up(16, bucket) == pytest.approx(0.9 * 2 - 0.35)
    rounds = costs.draft_round
    assert choose_drafts(0.9, 3, 0, 0.0, bucket, costs, rounds) == 3
    assert choose_drafts(0.9, 3, 0, 0.0, bucket, costs, rounds, costs.catch_up(16, bucket)) == 0
    assert choose_drafts(0.9, 3, 0, 0.0, bucket, costs) == 3  # lookup's: free to find


def test_beside_prompt_lookup_a_draft_model_far_behind_leaves_the_step_plain():
    """With catching up dear (the draft's steps of many tokens timed slow), a sequence whose
    lookup drafted lately takes plain steps where lookup finds nothing rather than the
    model's drafts: fewer of its rows, the same tokens, and its drawings still start from its
    own K/V (CheckedDraftModel)."""
    lookup = DRAFTING | {"prompt_lookup_max": 4, "prompt_lookup_min": 3}
    want, _, _, _ = _run(None, target=WrongDraft(every=7))  # a cycle broken every 7th token
    free, dear = WrongDraft(), WrongDraft()
    _, stats, _, _ = _run(lookup, draft=free, target=WrongDraft(every=7),
                          catch_up=dict.fromkeys([1, 2, 4, 8, 16, 32], 0.0))
    got, _, _, _ = _run(lookup, draft=dear, target=WrongDraft(every=7),
                        catch_up={1: 0.0, 2: 0.0, 4: 9.0, 8: 9.0, 16: 9.0, 32: 9.0})
    assert got == want and dear.checked.drawn < free.checked.drawn < stats.num_drafts


def _drafting_engine(draft_class, draft_runner, **limits) -> LLMEngine:
    """An engine on the fake model whose draft model (`draft_class`) runs on `draft_runner`,
    drafting whenever it may (EqualCosts)."""
    cfg = EngineConfig(model="fake", max_model_len=64, max_num_batched_tokens=32,
                       speculative=DRAFTING, **limits)
    tokenizer = types.SimpleNamespace(eos_token_ids=frozenset({EOS}), vocab_size=10**6)
    draft = draft_class(dataclasses.replace(cfg, speculative=None), draft_runner,
                        tokenizer.eos_token_ids)
    eng = LLMEngine(cfg, runner=FakeRunner(modulus=10), tokenizer=tokenizer, detokenize=False,
                    draft=draft)
    eng.scheduler.drafting.step_costs = EqualCosts()
    return eng


@pytest.mark.parametrize("prompt", [[3, 4, 5, 6, 7, 8], [i % 10 for i in range(-9, 8)]])
def test_a_prompts_first_token_comes_out_before_the_drafts_after_it(prompt):
    """Steps overlap until a sequence may draft; then the prompt's step is read and its first
    token returned at once, before the draft model's first round (which writes the draft's
    K/V for the whole prompt) and the drafting step after it. Also where the prompt's last
    token is a step of its own (17 tokens: 16, then 1, the step kept in its bucket): it is
    not a decode, so it brings no drafts."""
    draft_steps = []

    class CountingDraft(FakeRunner):
        def run(self, batch):
            draft_steps.append(batch.bucket[0])
            return super().run(batch)

    eng = _drafting_engine(DraftModel, CountingDraft(modulus=10), max_num_seqs=8,
                           async_scheduling=True)
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outputs = []
    while not outputs:
        outputs = eng.step()
    (first,) = outputs
    assert first.outputs[0].token_ids == [(prompt[-1] + 1) % 10] and draft_steps == []
    while eng.has_unfinished():
        outputs.extend(eng.step())
    assert draft_steps and eng.scheduler.drafting.stats.num_accepted_tokens > 0


def test_a_draft_models_rounds_go_to_the_device_back_to_back():
    """Without a grammar, a drawing's rounds are all dispatched before the first is read:
    each takes the draft before it from the device (the runner's last token of the slot),
    and the host reads the drafts after the last; the tokens are the target's."""
    events = []

    class Logged(FakeRunner):
        def submit(self, batch):
            events.append("s")
            done = super().submit(batch)
            return types.SimpleNamespace(result=lambda: events.append("r") or done.result())

    class Drawing(DraftModel):
        def draw(self, *args, **kwargs):
            events.append("|")
            return super().draw(*args, **kwargs)

    eng = _drafting_engine(Drawing, Logged(modulus=10), max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (out,) = eng.generate([[3, 4, 5, 6, 7, 8]], params)
    assert out.outputs[0].token_ids == [(9 + i) % 10 for i in range(12)]
    assert eng.scheduler.drafting.stats.num_accepted_tokens > 0
    drawings = [d for d in "".join(events).split("|") if d]
    assert drawings and all(d == "s" * (len(d) // 2) + "r" * (len(d) // 2) for d in drawings)
    assert max(map(len, drawings)) >= 2 * 3  # 3 drafts (a step of 4 tokens): 3 rounds


def test_a_draft_model_skips_the_pages_a_prefix_cache_hit_brings_its_kv_for():
    """The same prompt again: the draft's first round starts after the pages from the prefix
    cache (their draft K/V is there, written for that content); a prompt sharing only its
    first two pages starts after those two; the tokens are the target's in each."""
    firsts = []

    class Recording(DraftModel):
        def _submit(self, chunks, entries, j, seeds, grammar):
            if j == 0:
                firsts.extend((c.seq.seq_id, c.start) for c in chunks)
            return super()._submit(chunks, entries, j, seeds, grammar)

    eng = _drafting_engine(Recording, FakeRunner(modulus=10), max_num_seqs=4, block_size=4,
                           num_blocks=40)
    prompt = [3, 4, 5, 9, 9, 0, 1, 3, 4, 8, 8, 1, 1, 7, 7, 3, 5, 6]  # 4 whole pages and 2
    other = prompt[:8] + [2, 2] + prompt[10:]  # the same first two pages only
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    starts = []
    for p in (prompt, prompt, other):
        del firsts[:]
        (out,) = eng.generate([p], params)
        assert out.outputs[0].token_ids == [(p[-1] + 1 + i) % 10 for i in range(8)]
        starts.append(firsts[0][1])  # the first round's start for the request
    assert starts == [0, 16, 8]
    assert eng.scheduler.drafting.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("lookup", [False, True])
def test_a_draft_model_under_preemption_aborts_and_stops(lookup):
    """Preemption (the draft's K/V of a preempted sequence is written again from its start),
    an abort, and stops inside the drafts: the outputs without speculation; also with prompt
    lookup first."""
    spec = DRAFTING | ({"prompt_lookup_max": 4, "prompt_lookup_min": 1} if lookup else {})
    want, _, _, _ = _run(None, num_blocks=17, abort_at=5)
    got, stats, preemptions, _ = _run(spec, num_blocks=17, abort_at=5, draft=WrongDraft())
    assert preemptions > 0 and stats.num_accepted_tokens > 0
    got.pop("req-2"), want.pop("req-2")  # aborted (drafting reaches further by that step)
    assert got == want
    for params in [dict(ignore_eos=False), dict(stop_token_ids=[7]), dict(min_tokens=4)]:
        want, _, _, _ = _run(None, **params)
        got, stats, _, _ = _run(spec, draft=WrongDraft(), **params)
        assert got == want and stats.num_accepted_tokens > 0, params


def test_a_draft_model_must_share_the_targets_vocabulary():
    def tokenizer(pieces):
        return types.SimpleNamespace(vocab_size=len(pieces), id_to_token=pieces.__getitem__,
                                     convert_ids_to_tokens=lambda ids: [pieces[i] for i in ids])

    target = tokenizer(["a", "b", "c"])
    check_vocabulary(target, tokenizer(["a", "b", "c"]), "same")
    with pytest.raises(ValueError, match="vocabulary of 2 tokens, the target 3"):
        check_vocabulary(target, tokenizer(["a", "b"]), "short")
    with pytest.raises(ValueError, match="names token 1 'x', the target 'b'"):
        check_vocabulary(target, tokenizer(["a", "x", "c"]), "other")
    with pytest.raises(FileNotFoundError, match="draft model no/such/model does not exist"):
        DraftModel.for_target(EngineConfig(model="m", speculative={"model": "no/such/model"}),
                              target)


def test_a_draft_model_runs_its_prompts_in_bfloat16_where_it_pays(monkeypatch):
    from engine import draft_model
    from ops import native

    assert native.multiplies_bfloat16({"avx512f", "amx_bf16", "amx_tile"})         # SPR
    assert native.multiplies_bfloat16({"avx512f", "avx512_vnni", "avx512_bf16"})   # Zen 4
    assert not native.multiplies_bfloat16({"avx2", "fma", "f16c"})                 # Zen 1-3
    assert not native.multiplies_bfloat16(frozenset())                             # no flags
    for x in ["float32", "int8"]:
        target = EngineConfig(model="t", max_model_len=64, speculative=DRAFTING,
                              cpu_activation_dtype=x)
        # where the kernel takes every row count (8-bit x, VNNI), it keeps them
        for has, vnni, want in [(True, False, "bfloat16"), (False, False, "float32"),
                                (True, True, "float32" if x == "int8" else "bfloat16")]:
            monkeypatch.setattr(native, "multiplies_bfloat16", lambda has=has: has)
            monkeypatch.setattr(native, "multiplies_bytes", lambda vnni=vnni: vnni)
            cfg = draft_model.draft_config(target, "d")
            assert (cfg.model, cfg.speculative, cfg.cpu_matmul_dtype) == ("d", None, want)
            assert (cfg.max_model_len, cfg.cpu_activation_dtype) == (64, x)


def test_a_preempted_sequence_drafts_into_its_new_pages():
    """A draft model's batch is built only when a step drafts: a sequence preempted (its pages
    handed to another) and running again on other pages before the next drafting step must
    not keep the old pages in the draft's copy of its table."""
    from engine.block_manager import BlockManager
    from engine.scheduler import ScheduledSeq, SchedulerOutput
    from engine.sequence import TO_DRAW, Sequence, SequenceStatus

    cfg = EngineConfig(model="", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                       block_size=4, num_blocks=20)
    blocks = BlockManager(cfg.total_blocks, 4, enable_prefix_caching=False)
    draft = CheckedDraftModel(cfg, FakeRunner(modulus=10), frozenset())

    def drafts_once(seq, preempted=()):
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.token_ids.append(TO_DRAW)
        blocks.may_append(seq)
        entry = ScheduledSeq(seq, 2, seq.num_tokens - 2, samples=True, drafts=[TO_DRAW])
        draft.draw(SchedulerOutput([entry], list(preempted)), {})
        seq.token_ids.pop()
        return entry.drafts

    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=20), 4)
    blocks.allocate(a)
    a.status = SequenceStatus.RUNNING
    assert drafts_once(a) == [9]
    old = list(a.block_table)
    blocks.deallocate(a)                       # preempted ...
    a.status = SequenceStatus.WAITING
    b = Sequence(list(range(12)), SamplingParams(max_tokens=4), 4)
    blocks.allocate(b)                         # ... its pages go to another
    draft.draw(SchedulerOutput([], [a]), {})   # (the step that preempted it drafts nothing)
    blocks.allocate(a)                         # and it runs again, on other pages
    a.status = SequenceStatus.RUNNING
    assert not set(a.block_table) & set(old)
    checked = draft.tables_checked
    assert drafts_once(a) == [9] and draft.tables_checked > checked
    assert len(a.block_table) == len(old)      # (the length its stale copy had)
