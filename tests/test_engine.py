"""The engine on the real default model: continuous batching, prefix caching, preemption,
compilation discipline, seeded sampling and aborts.

One warmed-up engine serves the module; every test must leave all KV blocks free.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from conftest import SERVER_LIMITS

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from models.generate import GreedyDecoder

GAP = 1e-3
WORDS = ("the sea river mountain light keeper engine token page block cache quick brown fox "
         "jumps over lazy dog numbers 1 2 3 42 code def return while café 日本 🤖").split()


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def engine(default_gguf):
    # The live server's limits: its executables come from the store whoever compiled them.
    eng = LLMEngine(EngineConfig(model=str(default_gguf), **SERVER_LIMITS))
    eng.runner.warmup()
    return eng


@pytest.fixture(scope="module")
def plain(engine):
    from flax import nnx

    return GreedyDecoder(nnx.merge(engine.runner.graphdef, engine.runner.state), max_len=512,
                         kv_dtype=engine.runner.kv_dtype)  # float16 on CPU: the default


@pytest.fixture(autouse=True)
def all_blocks_free_after(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert not eng.has_unfinished()
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
        eng.block_manager.check_invariants()


def assert_greedy_equal(got: list[int], plain_output: tuple[list[int], np.ndarray]):
    """Token-identical to plain decoding (`GreedyDecoder.generate`'s tokens and logits for
    as many tokens), or diverging only at a near-tie (gap < 1e-3)."""
    want, logits = plain_output
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            top2 = np.sort(logits[i])[-2:]
            gap = float(top2[1] - top2[0])
            assert a == int(np.argsort(logits[i])[-2]) and gap < GAP, (
                f"diverges at token {i}: {a} vs {b}, top-2 gap {gap:.2e}")
            return


def test_concurrent_greedy_equals_alone_and_plain(engine, plain):
    rng = random.Random(0)
    prompts = [_prompt(rng, rng.choice([2, 5, 20, 60, 150])) for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 20), ignore_eos=True)
              for _ in prompts]
    together = engine.generate(prompts, params)
    for i, (prompt, p, out) in enumerate(zip(prompts, params, together, strict=True)):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == p.max_tokens and out.outputs[0].finish_reason == "length"
        want = plain.generate(engine.tokenizer.encode(prompt), p.max_tokens)
        assert_greedy_equal(tokens, want)
        if i % 4 == 0:  # alone too, for a quarter of them (every length occurs among those)
            assert_greedy_equal(engine.generate([prompt], p)[0].outputs[0].token_ids, want)


def test_prefix_cache_reuses_blocks_and_output(engine, plain):
    shared = _prompt(random.Random(1), 120)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = engine.generate([shared + " first"], p)[0]
    hits = engine.block_manager.prefix_cache_hits
    second = engine.generate([shared + " second"], p)[0]
    assert engine.block_manager.prefix_cache_hits > hits
    shared_len = len(engine.tokenizer.encode(shared))
    assert second.num_cached_tokens >= (shared_len // 16) * 16 - 16 > 0
    assert_greedy_equal(second.outputs[0].token_ids,
                        plain.generate(second.prompt_token_ids, len(second.outputs[0].token_ids)))
    again = engine.generate([shared + " first"], p)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_gives_the_same_greedy_outputs(engine):
    import dataclasses

    rng = random.Random(2)
    prompts = [_prompt(rng, 25) for _ in range(8)]
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = engine.generate(prompts, p)
    # Same runner (same compiled steps), but a block manager that holds 32 usable blocks of
    # 16 tokens (one max_model_len sequence, the least an engine starts with): far less than
    # the 8 sequences need together.
    small_cfg = dataclasses.replace(engine.config, num_blocks=33)
    small = LLMEngine(small_cfg, runner=engine.runner, tokenizer=engine.tokenizer)
    outs = small.generate(prompts, p)
    assert small.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in big]
    assert small.block_manager.num_free_blocks == small.block_manager.num_usable_blocks


def test_no_compilation_after_warmup(engine):
    rng = random.Random(3)
    prompts, params = [], []
    for _ in range(120):
        prompts.append(_prompt(rng, rng.randint(1, 80)))
        params.append(SamplingParams(
            temperature=rng.choice([0.0, 0.3, 0.8, 1.0, 1.5]),
            top_p=rng.choice([1.0, 0.9, 0.5]), top_k=rng.choice([0, 5, 50]),
            min_p=rng.choice([0.0, 0.05]), presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, -0.3]),
            repetition_penalty=rng.choice([1.0, 1.2]), seed=rng.choice([None, 7]),
            max_tokens=rng.randint(1, 12), logprobs=rng.choice([None, 0, 5]),
            n=rng.choice([1, 1, 2])))
    outs = engine.generate(prompts, params)
    assert len(outs) == 120 and all(o.finished for o in outs)
    assert engine.runner.compilations_after_warmup == 0


def test_seeded_sampling_is_independent_of_the_batch(engine):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = engine.generate(["Write a word:"], p)[0].outputs[0].token_ids
    rng = random.Random(4)
    others = [_prompt(rng, rng.randint(1, 40)) for _ in range(9)]
    mixed = engine.generate(others[:4] + ["Write a word:"] + others[4:],
                            [SamplingParams(temperature=0.7, max_tokens=10)] * 4 + [p]
                            + [SamplingParams(temperature=0.7, max_tokens=10)] * 5)
    assert mixed[4].outputs[0].token_ids == alone
    different = engine.generate(["Write a word:"], SamplingParams(
        temperature=1.0, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True))[0]
    assert different.outputs[0].token_ids != alone


def test_logprobs_are_returned(engine):
    out = engine.generate(["The sky is"], SamplingParams(temperature=0, max_tokens=4,
                                                         logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for lp, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok and lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.logprob <= 0


def test_stop_string_across_tokens_is_cut_and_never_leaked(engine):
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = engine.generate(["The capital of France is"], p)[0].outputs[0]
    tokens = [engine.tokenizer.decode([t]) for t in full.token_ids]
    # a stop string made of the end of token 3 and the start of token 4
    stop = tokens[3][-2:] + tokens[4][:2]
    assert len(stop) >= 3
    cut = full.text.find(stop)
    engine_out = engine.add_request("The capital of France is",
                                    SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    streamed = ""
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == engine_out:
                streamed += o.outputs[0].text  # (outputs are deltas)
                final = o
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert streamed == full.text[:cut]
    assert stop not in streamed


def test_abort_mid_generation_frees_blocks(engine):
    rid = engine.add_request("Tell me a long story about the sea.",
                             SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_usable_blocks
    out = engine.abort(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_requests_that_can_never_fit_are_rejected(engine):
    from engine.scheduler import RequestRejected

    with pytest.raises(RequestRejected, match="maximum context length is 512"):
        engine.add_request("hello", SamplingParams(max_tokens=600))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request([], SamplingParams())


def test_min_tokens_keeps_eos_from_being_picked(engine):
    from models.chat_template import ChatTemplate

    text = ChatTemplate.for_tokenizer(engine.tokenizer).render(
        [{"role": "user", "content": "Reply with the single word: yes"}],
        add_generation_prompt=True)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    short = engine.generate([ids], SamplingParams(temperature=0, max_tokens=60))[0].outputs[0]
    assert short.finish_reason == "stop"  # the model ends its reply by itself
    n = len(short.token_ids) + 4  # EOS came at n - 5: now it must not
    long = engine.generate([ids], SamplingParams(temperature=0, max_tokens=n + 8,
                                                 min_tokens=n))[0].outputs[0]
    assert len(long.token_ids) >= n
    assert not set(long.token_ids[:n]) & engine.tokenizer.eos_token_ids
    assert long.token_ids[:len(short.token_ids) - 1] == short.token_ids[:-1]


def test_a_shape_outside_the_table_is_refused_and_counted(engine):
    """The positive control of the no-compilation checks: both counters can move."""
    import jax

    from engine.batch import empty_batch
    from engine.model_runner import _active
    from engine.step_table import BucketMiss

    runner = engine.runner
    before = runner.compilations_after_warmup
    outside = (engine.config.max_num_batched_tokens * 2, 1)
    with pytest.raises(BucketMiss, match=r"\('tokens', 128\) is not in the warmed-up table"):
        runner.run(empty_batch(engine.config, outside))
    assert runner.compilations_after_warmup == before + 1
    # An XLA compilation while a warm runner steps is counted too (what a shape change
    # inside an executable's call would cost).
    _active.runner = runner
    try:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7.0)).block_until_ready()
    finally:
        _active.runner = None
    assert runner.compilations_after_warmup == before + 2
    runner.compilations_after_warmup = before


def _mixed_workload(tokenizer) -> tuple[list, list[SamplingParams]]:
    rng = random.Random(11)
    prompts = [_prompt(rng, rng.randint(2, 60)) for _ in range(14)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=18, logprobs=2),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=8, max_tokens=12, n=2),
        SamplingParams(temperature=0, max_tokens=40, stop=[" the", "."]),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=6),
        SamplingParams(temperature=0.5, seed=3, max_tokens=25, presence_penalty=0.8),
    ] * 2
    return prompts, params


def test_overlapped_steps_give_the_same_outputs(engine):
    """Dispatching step n+1 before reading step n (the default) changes no output: greedy,
    seeded, penalties, logprobs, stop strings, n > 1, min_tokens, mixed lengths."""
    import dataclasses

    prompts, params = _mixed_workload(engine.tokenizer)
    got, logprobs = {}, {}
    for overlap in (True, False):
        cfg = dataclasses.replace(engine.config, async_scheduling=overlap)
        eng = LLMEngine(cfg, runner=engine.runner, tokenizer=engine.tokenizer)
        outs = eng.generate(prompts, params)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
        got[overlap] = [[(c.token_ids, c.text, c.finish_reason,
                          [lp.token_id for lp in c.logprobs or []]) for c in o.outputs]
                        for o in outs]
        logprobs[overlap] = [lp.logprob for o in outs for c in o.outputs
                             for lp in c.logprobs or []]
    assert got[True] == got[False]
    # the steps differ in which rows share a batch, so float sums differ in the last bits
    np.testing.assert_allclose(logprobs[True], logprobs[False], atol=2e-3)
    finishes = {c[2] for o in got[True] for c in o}
    assert finishes == {"length", "stop"}  # both kinds of ending were exercised


def test_fused_small_decodes_give_what_body_then_head_give(engine, plain, monkeypatch):
    """A lone decode runs body and head as one executable; the same requests, each alone,
    with every step chained (body, then head) give the same outputs: greedy (also equal to
    plain decoding), seeded with logprobs, with penalties."""
    from engine.config import EngineConfig

    prompts, params = _mixed_workload(engine.tokenizer)
    runner = engine.runner
    fused = runner._executables[("step", 1)]
    calls = []

    def counting(*args):
        calls.append(1)
        return fused(*args)

    got, logprobs = {}, {}
    for fuse in (True, False):
        if fuse:
            monkeypatch.setitem(runner._executables, ("step", 1), counting)
        else:
            monkeypatch.setattr(EngineConfig, "step_buckets", property(lambda self: ()))
        outs = [engine.generate([p], [params[i]])[0] for i, p in enumerate(prompts[:3])]
        got[fuse] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
        logprobs[fuse] = [lp.logprob for o in outs for c in o.outputs for lp in c.logprobs or []]
        if fuse:
            assert len(calls) >= 40  # all but the first token of each request
            assert_greedy_equal(got[True][0][0][0],
                                plain.generate(engine.tokenizer.encode(prompts[0]), 20))
    assert got[True] == got[False]
    np.testing.assert_allclose(logprobs[True], logprobs[False], atol=2e-3)


def test_penalties_match_a_host_reference_across_reused_slots(engine, plain):
    """Greedy decoding with repetition / frequency / presence penalties, counted on the device
    per slot, equals argmax over numpy-penalized logits of a plain forward pass. Two waves, so
    later requests take slots that earlier ones (with other penalties or none) held."""
    rng = random.Random(12)
    waves = [[(_prompt(rng, rng.randint(3, 30)), SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=r,
        frequency_penalty=f, presence_penalty=p)) for r, f, p in combo]
        for combo in ([(1.4, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 0.0), (1.2, 0.3, 0.9)],
                      [(1.0, 0.0, 1.5), (1.5, -0.2, 0.0), (1.0, 0.0, 0.0)])]
    for wave in waves:
        outs = engine.generate([p for p, _ in wave], [sp for _, sp in wave])
        for (prompt, sp), out in zip(wave, outs, strict=True):
            ids = engine.tokenizer.encode(prompt)
            got = out.outputs[0].token_ids
            logits = plain.prompt_logits(ids + got[:-1])[len(ids) - 1:]
            for i, token in enumerate(got):
                x = logits[i].astype(np.float64)
                counts = np.bincount(got[:i], minlength=len(x)) if i else np.zeros(len(x))
                seen = (counts > 0) | np.isin(np.arange(len(x)), ids)
                r = sp.repetition_penalty
                x = np.where(seen, np.where(x > 0, x / r, x * r), x)
                x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
                top2 = np.sort(x)[-2:]
                assert token == int(np.argmax(x)) or top2[1] - top2[0] < GAP, (
                    f"token {i}: {token} vs {int(np.argmax(x))} ({sp})")
                if token != int(np.argmax(x)):
                    break  # a near-tie: the rest follows another path


def test_speculative_steps_give_the_same_outputs(engine, plain, monkeypatch):
    """Drafting by prompt lookup (engine/speculative.py) and by a draft model (the default
    model drafting for itself, engine/draft_model.py) changes no output: the mixed workload
    beside prompts that repeat themselves (so drafts are found, kept and rejected), greedy and
    seeded, with logprobs, stops and n > 1; no compilation; the greedy prompts equal plain
    decoding; prompt lookup's drafting steps run fused (body and head in one executable).
    The draft model's drafts are nearly all kept (its K/V kept in step with the
    target's through preemption-free rounds, rollbacks and prefix-cache hits)."""
    import dataclasses

    from fakes import EqualCosts

    from engine.draft_model import DraftModel
    from engine.model_runner import ModelRunner

    prompts, params = _mixed_workload(engine.tokenizer)
    copy = "Copy this list exactly: apple, river, stone, cloud, apple, river, stone, cloud. "
    words = "(apple|river|stone|cloud)"
    listed = StructuredOutputsParams(regex=f" ?{words}(, {words}){{0,11}}\\.")
    prompts = prompts + [copy * 2, "1 2 3 4 1 2 3 4 1 2 3", copy, copy]
    params = params + [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       SamplingParams(temperature=0.8, seed=21, max_tokens=40, logprobs=1),
                       SamplingParams(temperature=0, max_tokens=30, stop=["stone"]),
                       # a grammar: drafts cut where it forbids them, each verified row masked
                       SamplingParams(temperature=0.7, seed=4, max_tokens=40,
                                      structured_outputs=listed)]
    compiled = engine.runner.compilations_after_warmup
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    # The draft: the same model and limits, so its executables come from the store. Its
    # runner's config drafts, so it also has the fused drafting steps (body and head in one
    # executable, EngineConfig.step_buckets): prompt lookup runs on it.
    spare = ModelRunner(dataclasses.replace(engine.config, speculative=ngram))
    draft = DraftModel(engine.config, spare, engine.tokenizer.eos_token_ids)
    draft.warmup()
    fused = []
    for n in (2, 4):
        step = spare._executables[("step", n)]
        monkeypatch.setitem(spare._executables, ("step", n),
                            lambda *a, step=step, n=n: fused.append(n) or step(*a))
    got, logprobs, stats = {}, {}, {}
    for name, spec in [("plain", None), ("ngram", ngram),
                       ("draft", {"model": engine.config.model, "num_speculative_tokens": 3})]:
        cfg = dataclasses.replace(engine.config, speculative=spec)
        eng = LLMEngine(cfg, runner=spare if name == "ngram" else engine.runner,
                        tokenizer=engine.tokenizer, draft=draft if name == "draft" else None)
        eng.scheduler.drafting.step_costs = EqualCosts()  # drafting as on an accelerator at batch 1
        outs = eng.generate(prompts, params)
        # the grammar alone (drafting only while a step has few sequences): its drafts
        drafted = eng.scheduler.drafting.stats.num_accepted_tokens
        outs += eng.generate(prompts[-1:], params[-1:])
        grammar_kept = eng.scheduler.drafting.stats.num_accepted_tokens - drafted
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
        eng.block_manager.check_invariants()
        got[name] = [[(c.token_ids, c.text, c.finish_reason,
                       [lp.token_id for lp in c.logprobs or []]) for c in o.outputs]
                     for o in outs]
        logprobs[name] = [lp.logprob for o in outs for c in o.outputs for lp in c.logprobs or []]
        stats[name] = eng.scheduler.drafting.stats
        if name == "ngram":  # (the draft's rounds may run them too)
            fused_steps = list(fused)
        assert name == "plain" or grammar_kept > 0, name
    for name in ("ngram", "draft"):
        assert got[name] == got["plain"], name
        np.testing.assert_allclose(logprobs[name], logprobs["plain"], atol=2e-3)
    assert 0 < stats["ngram"].num_accepted_tokens < stats["ngram"].num_draft_tokens
    assert {2, 4} <= set(fused_steps)  # drafting steps ran fused
    assert stats["draft"].num_accepted_tokens >= 0.9 * stats["draft"].num_draft_tokens > 0
    # A prompt again from the prefix cache: the draft skips its pages (their draft K/V is
    # there) and its drafts are still kept, as they would not be over wrong K/V.
    written, written_by = [], draft._written
    monkeypatch.setattr(draft, "_written",
                        lambda seq, cache: written.append(written_by(seq, cache)) or written[-1])
    eng = LLMEngine(dataclasses.replace(engine.config, speculative={
        "model": engine.config.model, "num_speculative_tokens": 3}), runner=engine.runner,
        tokenizer=engine.tokenizer, draft=draft)
    eng.scheduler.drafting.step_costs = EqualCosts()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = eng.generate([copy * 3], [greedy])
    kept, proposed = (eng.scheduler.drafting.stats.num_accepted_tokens,
                      eng.scheduler.drafting.stats.num_draft_tokens)
    assert eng.generate([copy * 3], [greedy])[0].outputs[0].token_ids == \
        first[0].outputs[0].token_ids
    stats = eng.scheduler.drafting.stats
    assert written[-1] >= 3 * engine.config.block_size, written
    assert stats.num_accepted_tokens - kept >= 0.9 * (stats.num_draft_tokens - proposed) > 0
    assert engine.runner.compilations_after_warmup == compiled
    assert draft.runner.compilations_after_warmup == 0 and draft.runner.num_stored_loads > 0
    draft.runner.release()
    assert_greedy_equal(got["plain"][-5][0][0],
                        plain.generate(engine.tokenizer.encode(prompts[-4]), 40))
    assert got["plain"][-1] == got["plain"][-2]  # the grammar alone as in the batch
    text = got["plain"][-1][0][1]
    assert re.fullmatch(listed.regex, text) and text.count(",") >= 2, text


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_keeps_the_sampled_distribution(method, request):
    """The second token sampled at temperature 0.8 after a prompt that repeats itself (so
    drafts verify it), 4,000 draws with and without drafting, each draw its own seed: the two
    histograms pass a chi-squared test of one distribution (p > 0.01). Prompt lookup on the
    default model; Qwen2.5-Coder-0.5B drafting for the 1.5B (both int4), a draft model of
    another distribution, so its drafts are rejected at times (each draft drawn from the
    0.5B's distribution, kept by the 1.5B's draw). Seeds are not paired across the two runs
    (draws 0..3999 without, 4000..7999 with), so this checks the distribution, not only the
    seed-for-seed equality the test above holds."""
    import dataclasses

    from fakes import EqualCosts
    from scipy.stats import chi2_contingency

    from models.known_models import fetch_model

    if method == "ngram":
        target = request.getfixturevalue("engine")
        spec = {"method": "ngram", "num_speculative_tokens": 1, "max_seqs": 8}
    else:
        target = LLMEngine(EngineConfig(
            model=str(fetch_model("qwen2.5-coder-1.5b", quiet=True)), quantization="int4",
            max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128))
        target.runner.warmup()
        spec = {"model": str(fetch_model("qwen2.5-coder-0.5b", quiet=True)),
                "num_speculative_tokens": 1, "max_seqs": 8}
    prompt = "red green blue red green blue red green blue red green"
    counts = []
    for spec_or_none, first_seed in ((None, 0), (spec, 4000)):
        cfg = dataclasses.replace(target.config, speculative=spec_or_none)
        eng = LLMEngine(cfg, runner=target.runner, tokenizer=target.tokenizer)
        if eng.draft is not None:
            eng.draft.warmup()
        eng.scheduler.drafting.step_costs = EqualCosts()
        seen: dict[int, int] = {}
        for wave in range(first_seed, first_seed + 4000, 8):  # 8 at a time: all may draft
            outs = eng.generate([prompt] * 8, [SamplingParams(  # (a third token: room to draft)
                temperature=0.8, seed=s, max_tokens=3, ignore_eos=True)
                for s in range(wave, wave + 8)])
            for o in outs:
                token = o.outputs[0].token_ids[1]
                seen[token] = seen.get(token, 0) + 1
        counts.append(seen)
        if spec_or_none is not None:
            stats = eng.scheduler.drafting.stats
            assert stats.num_drafts > 1000  # (its first token, when it repeats)
            if method == "draft_model":  # drafts of another distribution: some rejected
                assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
                eng.release()  # the two Qwen models' memory (the module's engine stays)
    tokens = sorted(set(counts[0]) | set(counts[1]))
    table = np.array([[c.get(t, 0) for t in tokens] for c in counts])
    table = table[:, table.sum(axis=0) >= 10]  # chi-squared needs populated cells
    assert table.shape[1] >= 2
    assert chi2_contingency(table).pvalue > 0.01
