"""OpenAI's `logit_bias` and `n` up to 128: the sampler alone (-100 bans, +100 is exclusive,
a small bias shifts the distribution, rows without a bias stay bit for bit, new biases do not
recompile), the step buffers, the engine on the default model (bans and forced tokens over
1,000 draws, no compilation after warmup, n=128 computing its prompt once), and the HTTP
layer's 400s and /openapi.json."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SERVER_LIMITS
from fakes import make_engine
from starlette.testclient import TestClient
from test_batch import build, entry
from test_sampling import DRAWS, LOGITS, chi2_pvalue, log_softmax64, metadata, target

import engine.batch
import engine.sampling_params
import ops.sampling_metadata
from engine.async_engine import Engines
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from ops.sampling import sample
from server.app import build_app
from server.openapi import integer_pattern

TRACES: list = []


@jax.jit
def sample_jit(logits, md):
    TRACES.append(jax.tree.map(jnp.shape, (logits, md)))
    return sample(logits, md)


def with_bias(md, row_biases: dict[int, dict[int, float]]):
    """`md` with {row: {id: bias}} written into its logit_bias columns."""
    for row, biases in row_biases.items():
        md.logit_bias_ids[row, :len(biases)] = list(biases)
        md.logit_bias[row, :len(biases)] = list(biases.values())
    return md


def test_the_layout_constants_agree_across_layers():
    # engine/ may not import ops/: the limits are written twice and must stay equal.
    assert (engine.batch.MAX_BANNED == ops.sampling_metadata.MAX_BANNED)
    assert (engine.sampling_params.MAX_LOGIT_BIAS == engine.batch.MAX_LOGIT_BIAS
            == ops.sampling_metadata.MAX_LOGIT_BIAS)
    assert engine.sampling_params.MAX_BIAS == ops.sampling_metadata.MAX_BIAS == 100


# ---- the sampler alone ----------------------------------------------------------------


def test_minus_100_bans_and_logprobs_stay_raw():
    # LOGITS' argmax is id 1, then 5: greedy and hot rows with both banned
    md = with_bias(metadata(2, temperature=np.array([0.0, 2.0], np.float32),
                            num_top_logprobs=0), {0: {1: -100, 5: -100}, 1: {1: -100, 5: -100}})
    out = sample_jit(jnp.asarray(np.stack([LOGITS, LOGITS])), md)
    assert int(out.token_ids[0]) == 3  # the best id left
    np.testing.assert_allclose(float(out.logprobs[0]), log_softmax64(LOGITS)[3], rtol=1e-5)
    many = with_bias(metadata(DRAWS, temperature=2.0), {r: {1: -100, 5: -100}
                                                        for r in range(DRAWS)})
    draws = np.asarray(sample_jit(jnp.asarray(np.tile(LOGITS, (DRAWS, 1))), many).token_ids)
    assert not np.isin(draws, [1, 5]).any()
    assert np.isin(draws, [0, 3]).any()  # the others are drawn


def test_plus_100_is_exclusive_even_against_penalties_and_heat():
    # id 4 is the least likely (-3); +100 on it, at temperature 0, 1 and 2, and with the
    # largest frequency penalty after 60 draws of it: only id 4 is ever picked.
    n = 3 * 1000
    md = metadata(n, temperature=np.repeat(np.array([0.0, 1.0, 2.0], np.float32), 1000),
                  frequency_penalty=2.0, presence_penalty=2.0)
    md.output_counts[:, 4] = 60
    md = with_bias(md, {r: {4: 100} for r in range(n)})
    draws = np.asarray(sample_jit(jnp.asarray(np.tile(LOGITS, (n, 1))), md).token_ids)
    assert set(np.unique(draws)) == {4}
    # Two +100 ids share the draw by their own logits (ids 0 and 2: 0.5 and -1.0).
    md = with_bias(metadata(DRAWS, temperature=1.0), {r: {0: 100, 2: 100, 3: -5}
                                                      for r in range(DRAWS)})
    draws = np.asarray(sample_jit(jnp.asarray(np.tile(LOGITS, (DRAWS, 1))), md).token_ids)
    counts = np.bincount(draws, minlength=len(LOGITS))
    assert counts.sum() == counts[[0, 2]].sum() == DRAWS
    p = np.exp([0.5, -1.0]) / np.exp([0.5, -1.0]).sum()
    assert chi2_pvalue(counts[[0, 2]], p) > 1e-3


def test_plus_100_on_a_banned_id_does_not_unban_it():
    # min_tokens bans id 1 (the argmax); +100 on it leaves the row as if unbiased
    md = with_bias(metadata(1, temperature=0.0), {0: {1: 100}})
    md.banned_tokens[0, 0] = 1
    assert int(sample_jit(jnp.asarray(LOGITS[None]), md).token_ids[0]) == 5


def test_a_small_bias_shifts_the_distribution_before_temperature():
    bias = {2: 2.5, 5: -1.0, 0: 0.7}
    shifted = LOGITS.copy()
    for i, b in bias.items():
        shifted[i] += b
    for temperature in (1.0, 0.6):
        md = with_bias(metadata(DRAWS, temperature=temperature),
                       {r: bias for r in range(DRAWS)})
        draws = np.asarray(sample_jit(jnp.asarray(np.tile(LOGITS, (DRAWS, 1))), md).token_ids)
        counts = np.bincount(draws, minlength=len(LOGITS))
        assert chi2_pvalue(counts, target(shifted, temperature=temperature)) > 1e-3
        assert chi2_pvalue(counts, target(LOGITS, temperature=temperature)) < 1e-3


def test_rows_without_a_bias_are_unchanged_bit_for_bit():
    rng = np.random.default_rng(5)
    num, vocab = 64, 300
    logits = rng.normal(size=(num, vocab)).astype(np.float32) * 3
    md = metadata(num, vocab, temperature=rng.choice([0.0, 0.7, 1.0, 1.5], num).astype(
        np.float32), top_p=rng.choice([1.0, 0.9], num).astype(np.float32),
        top_k=rng.choice([0, 20], num).astype(np.int32), num_top_logprobs=5)
    md.steps[:] = rng.integers(0, 1000, num)
    plain = sample_jit(jnp.asarray(logits), md)
    biased = with_bias(jax.tree.map(np.copy, md), {0: {3: 100}, 7: {int(logits[7].argmax()): -100,
                                                                    11: 4.0}})
    out = sample_jit(jnp.asarray(logits), biased)
    others = np.setdiff1d(np.arange(num), [0, 7])
    for name in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(out, name))[others],
                                      np.asarray(getattr(plain, name))[others], err_msg=name)
    assert int(out.token_ids[0]) == 3
    assert int(out.token_ids[7]) != int(logits[7].argmax())
    # the biased rows' logprobs are the model's own (raw) too
    np.testing.assert_allclose(float(out.logprobs[0]), log_softmax64(logits[0])[3], rtol=1e-5)


def test_new_biases_do_not_recompile():
    logits = jnp.asarray(np.tile(LOGITS, (4, 1)))
    for seed, bias in enumerate([{}, {1: -100}, {2: 100, 3: 1.5}, {i: -1.0 for i in range(8)}]):
        md = with_bias(metadata(4, temperature=1.0), {r: bias for r in range(4)})
        md.steps[:] = seed
        jax.block_until_ready(sample_jit(logits, md))
    assert TRACES.count(jax.tree.map(jnp.shape, (logits, md))) == 1


# ---- the step buffers -----------------------------------------------------------------


def test_the_step_carries_each_rows_biases_and_padding_carries_none():
    biased = entry([10, 11, 12], [1], start=2, n=1, prompt=2,
                   logit_bias={"40": 2.5, 7: -100, 63: 100})
    plain = entry([10, 11, 12], [2], start=2, n=1, prompt=2)
    batch, _ = build(plain, biased)
    ids, biases = batch.sampling["logit_bias_ids"], batch.sampling["logit_bias"]
    assert ids.shape == biases.shape == (2, MAX_LOGIT_BIAS)
    np.testing.assert_array_equal(ids[1, :4], [7, 40, 63, -1])
    np.testing.assert_array_equal(biases[1, :3], [-100, 2.5, 100])
    assert (ids[0] == -1).all() and (biases[0] == 0).all()
    assert (ids[1, 3:] == -1).all()
    batch, _ = build(plain)  # a step without biases writes none
    assert (batch.sampling["logit_bias_ids"] == -1).all()


def test_a_bias_that_rounds_to_100_in_float32_stays_below_it():
    p = SamplingParams(logit_bias={1: 99.999999999, 2: -99.999999999, 3: 100})
    (_, up), (_, down), (_, full) = p.logit_bias
    assert np.float32(up) < 100 and np.float32(down) > -100 and full == 100


# ---- the engine on the default model ----------------------------------------------------

PROMPT = "The capital of France is"  # greedy: " Paris", about 3 in 4 draws at temperature 1


@pytest.fixture(scope="module")
def llm(default_gguf):
    # The live server's limits (max_num_seqs 16): the executables come from the store
    # tests/test_engine.py fills.
    eng = LLMEngine(EngineConfig(model=str(default_gguf), **SERVER_LIMITS))
    eng.runner.warmup()
    return eng


@pytest.fixture(autouse=True)
def nothing_compiled_or_held_after(request):
    yield
    if "llm" in request.fixturenames:
        eng = request.getfixturevalue("llm")
        assert eng.runner.compilations_after_warmup == 0
        assert not eng.has_unfinished()
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks


def _tokens(eng, prompt, **params) -> list[list[int]]:
    out = eng.generate([prompt], SamplingParams(**params))[0]
    return [o.token_ids for o in out.outputs]


def test_minus_100_on_the_greedy_token_keeps_it_out_of_1000_draws(llm):
    greedy = _tokens(llm, PROMPT, temperature=0, max_tokens=1)[0][0]
    # without the bias it is most first draws (so the ban below can fail) ...
    firsts = [t[0] for t in _tokens(llm, PROMPT, temperature=1.0, n=125, max_tokens=1, seed=1)]
    assert firsts.count(greedy) > 50
    # ... with it, none of 1,000 (125 sequences, more than max_num_seqs, of 8 tokens)
    drawn = _tokens(llm, PROMPT, temperature=1.0, n=125, max_tokens=8, seed=1, ignore_eos=True,
                    logit_bias={greedy: -100})
    assert sum(map(len, drawn)) == 1000
    assert greedy not in {t for seq in drawn for t in seq}


def test_plus_100_on_an_unlikely_token_makes_every_draw_that_token(llm):
    unlikely = 12345
    for temperature in (0.0, 1.0, 2.0):
        out = llm.generate([PROMPT], SamplingParams(
            temperature=temperature, n=16, max_tokens=8, ignore_eos=True, seed=3, logprobs=0,
            frequency_penalty=2.0, logit_bias={str(unlikely): 100}))[0]
        assert {t for o in out.outputs for t in o.token_ids} == {unlikely}
        # the model itself gives it little: the reported logprob is the raw one
        assert out.outputs[0].logprobs[0].logprob < np.log(1e-4)


def test_a_biased_request_leaves_its_neighbours_draws_alone(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=11, ignore_eos=True)
    alone = llm.generate(["Tell me about the sea"], seeded)[0].outputs[0].token_ids
    rng = random.Random(0)
    biased = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                             logit_bias={rng.randrange(49152): rng.choice([-100, 5, 100])
                                         for _ in range(rng.randint(1, MAX_LOGIT_BIAS))})
              for _ in range(5)]
    together = llm.generate(["Tell me about the sea"] + ["Once upon a"] * 5, [seeded, *biased])
    assert together[0].outputs[0].token_ids == alone


# A repeat (slow): the bias is in the sampler every head row goes through, drafted or not
# (test_engine's speculative test holds the drafted rows to the plain ones).
@pytest.mark.slow
def test_speculative_decoding_draws_what_the_biased_target_draws(llm):
    """Prompt lookup and a draft model (the default model drafting for itself, with the
    target's sampling parameters, biases included) give what plain decoding gives: drafts the
    bias bans are rejected, the rest kept. Greedy and forced rows only: a seeded draw at a
    temperature can flip where the step's shape moves a logit's last bits (on CPU without
    --batch-invariant; seen with and without logit_bias)."""
    import dataclasses

    from fakes import EqualCosts

    from engine.draft_model import DraftModel
    from engine.model_runner import ModelRunner

    copy = "Copy this list exactly: apple, river, stone, cloud, apple, river, stone, cloud. "
    stone = llm.tokenizer.encode(" stone", add_special_tokens=False)[0]
    prompts = [copy * 2, copy * 2, copy]
    params = [SamplingParams(temperature=0, max_tokens=30, logit_bias={stone: -100}),
              SamplingParams(temperature=0, max_tokens=30, logit_bias={stone: 3.0, 11: -100}),
              SamplingParams(temperature=1.0, seed=6, max_tokens=6, n=2,
                             logit_bias={stone: 100})]
    draft = DraftModel(llm.config, ModelRunner(llm.config), llm.tokenizer.eos_token_ids)
    draft.warmup()
    got, kept = {}, {}
    for name, spec in [("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4}),
                       ("draft", {"model": llm.config.model, "num_speculative_tokens": 3})]:
        eng = LLMEngine(dataclasses.replace(llm.config, speculative=spec), runner=llm.runner,
                        tokenizer=llm.tokenizer, draft=draft if name == "draft" else None)
        eng.scheduler.drafting.step_costs = EqualCosts()  # drafting as on an accelerator at batch 1
        got[name] = [[c.token_ids for c in o.outputs] for o in eng.generate(prompts, params)]
        kept[name] = eng.scheduler.drafting.stats.num_accepted_tokens
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
    assert draft.runner.compilations_after_warmup == 0
    draft.runner.release()
    assert got["ngram"] == got["plain"] and got["draft"] == got["plain"]
    assert kept["ngram"] > 0 and kept["draft"] > 0
    assert stone not in got["plain"][0][0] and stone in got["plain"][1][0]
    assert {t for seq in got["plain"][2] for t in seq} == {stone}


def test_n_128_returns_128_choices_and_computes_the_prompt_once(llm):
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 10)  # ~100 tokens
    ids = llm.tokenizer.encode(prompt)
    block = llm.config.block_size
    shared = (len(ids) - 1) // block  # full blocks a sibling can take from the cache
    computed = []  # prompt tokens each step computes
    schedule = llm.scheduler.schedule

    def counting(*args, **kwargs):
        out = schedule(*args, **kwargs)
        computed.append(sum(max(0, min(e.end, len(ids)) - e.start) for e in out.scheduled))
        return out

    llm.scheduler.schedule = counting
    hits = llm.block_manager.prefix_cache_hits
    try:
        out = llm.generate([ids], SamplingParams(temperature=1.0, n=128, max_tokens=2,
                                                 seed=2, ignore_eos=True))[0]
    finally:
        del llm.scheduler.schedule
    assert len(out.outputs) == 128 and [o.index for o in out.outputs] == list(range(128))
    assert all(len(o.token_ids) == 2 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # each its own draw
    # One sequence computes the whole prompt; each of the 127 others only its last block.
    assert sum(computed) == len(ids) + 127 * (len(ids) - shared * block)
    assert llm.block_manager.prefix_cache_hits - hits == 127 * shared


# ---- HTTP --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tokenizer):
    engine, _ = make_engine(tokenizer, name="fake")
    with TestClient(build_app(Engines({"fake": engine}))) as c:
        yield c
    engine.shutdown()


ROUTES = {"/v1/completions": {"prompt": "hi"},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("bias,words", [
    ({"five": 1}, "logit_bias"), ({"-1": 1}, "logit_bias"), ({"1.5": 1}, "logit_bias"),
    ({"05": 1}, "logit_bias"), ({"49152": 1}, "outside the vocabulary [0, 49152)"),
    ({"99999999999": 1}, "logit_bias"), ({"5": 101}, "logit_bias"), ({"5": -100.5}, "logit_bias"),
    ({"5": "much"}, "logit_bias"), ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, "at most"),
    ([5, 1], "logit_bias"),
])
def test_a_bad_logit_bias_is_a_400_naming_it(client, route, bias, words):
    r = client.post(route, json={"model": "fake", "max_tokens": 2, **ROUTES[route],
                                 "logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == "logit_bias" and words in err["message"], err


@pytest.mark.parametrize("route", ROUTES)
def test_a_good_logit_bias_and_n_128_are_served(client, route):
    bias = {str(i): (-1) ** i * 100.0 * i / MAX_LOGIT_BIAS for i in range(MAX_LOGIT_BIAS - 1)}
    r = client.post(route, json={"model": "fake", "max_tokens": 2, **ROUTES[route],
                                 "logit_bias": bias | {"49151": 100}, "n": 128})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 128


def test_n_times_prompts_is_bounded(client):
    r = client.post("/v1/completions", json={"model": "fake", "max_tokens": 1, "n": 128,
                                             "prompt": ["hi"] * 33})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "4096" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "fake", "max_tokens": 1, "n": 129,
                                             "prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_openapi_says_what_logit_bias_takes(client, tokenizer):
    props = client.get("/openapi.json").json()["components"]["schemas"]
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        field = props[model]["properties"]["logit_bias"]
        schema = next(s for s in field["anyOf"] if s.get("type") == "object")
        assert schema["maxProperties"] == MAX_LOGIT_BIAS
        assert schema["propertyNames"] == {"pattern": integer_pattern(tokenizer.vocab_size - 1)}
        assert schema["additionalProperties"] == {"type": "number", "minimum": -100,
                                                  "maximum": 100}
        assert props[model]["properties"]["n"]["maximum"] == 128


def test_the_key_pattern_is_exactly_the_ids_below_the_vocabulary():
    import re

    for most in (0, 9, 10, 99, 100, 109, 49151, 151935):
        pattern = re.compile(integer_pattern(most))
        accepted = [i for i in range(most * 2 + 20) if pattern.fullmatch(str(i))]
        assert accepted == list(range(most + 1)), most
        for bad in ("", "00", "01", "-1", "+1", " 1", "1.0", "1e3", f"0{most}"):
            assert not pattern.fullmatch(bad), (most, bad)
