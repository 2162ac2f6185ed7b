"""ops/sampling.py against exact numpy references: the sampled distributions (chi-square),
greedy rows, per-row reproducibility, vLLM's penalties, raw logprobs, and no recompiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import chi2

import ops.sampling
import ops.sampling_cutoffs
from ops.sampling import (
    BLOCK,
    CANDIDATES,
    apply_penalties,
    probs,
    sample,
    token_counts,
)
from ops.sampling_cutoffs import _blocked_top_k
from ops.sampling_metadata import (
    NUM_TOP_LOGPROBS,
    SamplingMetadata,
    row_uniforms,
    seed_words,
    threefry2x32,
)

LOGITS = np.array([0.5, 2.0, -1.0, 1.0, -3.0, 1.5, 0.0, -0.5], np.float32)  # V = 8, no ties
DRAWS = 20_000

TRACES: list[tuple] = []  # one entry per trace of sample_jit: the input shapes


@jax.jit
def sample_jit(logits, md):
    # Shared by all tests so that each shape compiles once; counts its traces (test 7).
    TRACES.append(jax.tree.map(jnp.shape, (logits, md)))
    return sample(logits, md)


def metadata(num_seqs: int, vocab: int = len(LOGITS), **columns) -> SamplingMetadata:
    """Padding-row metadata (count tables of `vocab` ids) with distinct seeds, then `columns`
    written over it."""
    md = SamplingMetadata.dummy(num_seqs, vocab)
    md.seeds[:, 1] = np.arange(num_seqs)
    for name, value in columns.items():
        getattr(md, name)[...] = value
    return md


def rows(mds: list[SamplingMetadata]) -> SamplingMetadata:
    """Stack single-purpose metadata blocks into one batch (each row keeps its own slot)."""
    md = jax.tree.map(lambda *xs: np.concatenate(xs), *mds)
    md.slots = np.arange(len(md.slots), dtype=np.int32)
    return md


def with_tokens(md: SamplingMetadata, output: np.ndarray, prompt: np.ndarray | None = None,
                vocab_size: int | None = None) -> SamplingMetadata:
    """Per-slot tables counted from [S, N] output (and prompt) ids padded with -1, as the
    engine keeps them on the device."""
    v = vocab_size or md.output_counts.shape[1]
    md.output_counts = np.asarray(token_counts(jnp.asarray(output), v))
    md.prompt_mask = (np.zeros((len(output), v), bool) if prompt is None
                      else np.asarray(token_counts(jnp.asarray(prompt), v)) > 0)
    return md


# ---- numpy references -----------------------------------------------------------------


def log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def target(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, min_p_last=False):
    """vLLM v1: temperature -> min-p -> top-k -> top-p over the renormalised survivors.
    `min_p_last` moves min-p after top-p (vLLM v0's order): a wrong target for the tests."""
    logits = np.asarray(logits, np.float64)
    p = np.exp(log_softmax64(logits / temperature))
    keep = np.ones(len(p), bool) if min_p_last else p >= min_p * p.max()
    if 0 < top_k < len(logits):
        keep &= logits >= np.sort(logits)[::-1][top_k - 1]
    q = np.where(keep, p, 0.0) / p[keep].sum()
    if top_p < 1:
        order = np.argsort(-q)
        mass_before = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
        q[order[mass_before >= top_p]] = 0.0
        q /= q.sum()
    if min_p_last:
        q[q < min_p * q.max()] = 0.0
        q /= q.sum()
    return q


def ref_penalties(logits, prompt, output, rep, freq, pres):
    out = np.asarray(logits, np.float64).copy()
    for s in range(out.shape[0]):
        seen = np.unique(np.concatenate([prompt[s][prompt[s] >= 0], output[s][output[s] >= 0]]))
        out[s, seen] = np.where(out[s, seen] > 0, out[s, seen] / rep[s], out[s, seen] * rep[s])
        counts = np.bincount(output[s][output[s] >= 0], minlength=out.shape[1])
        out[s] -= freq[s] * counts + pres[s] * (counts > 0)
    return out


def chi2_pvalue(counts, p):
    """p-value of `counts` under `p`; 0 if a token with p == 0 was drawn."""
    if counts[p == 0].any():
        return 0.0
    expected = counts.sum() * p[p > 0]
    stat = ((counts[p > 0] - expected) ** 2 / expected).sum()
    return float(chi2.sf(stat, (p > 0).sum() - 1))


# ---- 1. the sampled distributions -----------------------------------------------------

# (parameters, the target with one thing wrong): the test must reject the wrong target.
CASES = {
    "temperature=1": (dict(temperature=1.0), dict(temperature=0.8)),
    "temperature=0.5": (dict(temperature=0.5), dict(temperature=1.0)),
    "top_k=3": (dict(temperature=1.0, top_k=3), dict(temperature=1.0)),
    "top_p=0.8": (dict(temperature=1.0, top_p=0.8), dict(temperature=1.0)),
    "min_p=0.2": (dict(temperature=1.0, min_p=0.2), dict(temperature=1.0)),
    "combined": (dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
                 dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05)),
    "min_p before top_p": (dict(temperature=0.9, top_p=0.8, min_p=0.3),
                           dict(temperature=0.9, top_p=0.8, min_p=0.3, min_p_last=True)),
}
# The same 8 logits spread over three 256-token blocks of the draw (the last one partial).
SPREAD = np.array([0, 255, 256, 300, 511, 512, 519, 100])
SPREAD_VOCAB = 520


def counts_of(logits: np.ndarray, md: SamplingMetadata, groups: int) -> np.ndarray:
    tokens = np.asarray(sample_jit(jnp.asarray(logits), md).token_ids).reshape(groups, -1)
    return np.stack([np.bincount(t, minlength=logits.shape[1]) for t in tokens])


@pytest.fixture(scope="module")
def draws():
    """One batched call: DRAWS rows per case, all with the same logits and distinct seeds."""
    md = rows([metadata(DRAWS, **params) for params, _ in CASES.values()])
    md.seeds[:, 1] = np.arange(len(md.temperature))
    logits = np.broadcast_to(LOGITS, (len(md.temperature), len(LOGITS)))
    return dict(zip(CASES, counts_of(logits, md, len(CASES)), strict=True))


@pytest.mark.parametrize("case", CASES)
def test_empirical_distribution_matches_target(draws, case):
    params, wrong = CASES[case]
    p = target(LOGITS, **params)
    counts = draws[case]
    assert counts.sum() == DRAWS
    assert counts[p == 0].sum() == 0, "a filtered token was drawn"
    assert chi2_pvalue(counts, p) > 1e-3
    assert chi2_pvalue(counts, target(LOGITS, **wrong)) < 1e-3, "the test cannot tell"


def test_draw_across_vocabulary_blocks():
    draws = DRAWS // 2
    logits = np.full((draws, SPREAD_VOCAB), -np.inf, np.float32)
    logits[:, SPREAD] = LOGITS
    md = metadata(draws, SPREAD_VOCAB, temperature=1.0, top_p=0.95)
    md.seeds[:, 0] = 7
    counts = counts_of(logits, md, 1)[0]
    assert counts.sum() == counts[SPREAD].sum() == draws
    assert chi2_pvalue(counts[SPREAD], target(LOGITS, top_p=0.95)) > 1e-3
    assert chi2_pvalue(counts[SPREAD], target(LOGITS, temperature=0.8)) < 1e-3


def test_targets_exclude_tokens():
    # The filter cases must actually filter, or their masked-token check is vacuous.
    for case in ("top_k=3", "top_p=0.8", "min_p=0.2", "combined", "min_p before top_p"):
        assert (target(LOGITS, **CASES[case][0]) == 0).any(), case


def test_probs_match_reference_on_both_cutoff_paths():
    # V > CANDIDATES: top_k=100 and wide nuclei take the bisection, the rest the fast path.
    vocab = 300
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(7, vocab)).astype(np.float32)
    logits[6] = 0.0                       # all equal: ties at a cutoff are all kept
    logits[1] *= 0.3                      # flat: the 0.9 nucleus is far wider than 64 tokens
    logits[3, :5] += 8                    # peaked: the nucleus is a few tokens
    params = [dict(temperature=1.0, top_k=10), dict(temperature=1.0, top_p=0.9),
              dict(temperature=0.8, top_k=100), dict(temperature=1.0, top_p=0.5),
              dict(temperature=1.5, top_k=150, top_p=0.95, min_p=0.1),
              dict(temperature=0.0, top_p=0.5), dict(temperature=1.0, top_k=10, top_p=0.5)]
    md = rows([metadata(1, vocab, **p) for p in params])
    got = np.asarray(jax.jit(probs)(jnp.asarray(logits), md))
    np.testing.assert_allclose(got[6], np.full(vocab, 1 / vocab), rtol=1e-6)
    for s, p in enumerate(params[:6]):
        want = (np.eye(vocab)[logits[s].argmax()] if p["temperature"] == 0
                else target(logits[s], **p))
        np.testing.assert_array_equal(got[s] > 0, want > 0, err_msg=str(p))
        np.testing.assert_allclose(got[s], want, rtol=1e-4, atol=1e-7, err_msg=str(p))
    assert (got[1] > 0).sum() > CANDIDATES  # the bisection really ran


@pytest.mark.parametrize("k", [1, 20, CANDIDATES])
def test_blocked_top_k_is_lax_top_k_ties_included(k):
    # What a GPU runs: the same values and ids as lax.top_k, on rows with many ties (values
    # on a coarse grid), a row of equal values, -inf entries, a vocabulary not a multiple of
    # BLOCK, and a row whose top values crowd into one block.
    vocab = BLOCK * (2 * CANDIDATES + 3) + 17
    rng = np.random.default_rng(k)
    x = np.round(rng.normal(size=(6, vocab)) * 4).astype(np.float32)
    x[1] = 0.0
    x[2, rng.choice(vocab, vocab // 2, replace=False)] = -np.inf
    x[3, 5 * BLOCK:5 * BLOCK + 2 * k] += 100
    x[4] = -np.inf
    x[4, -3:] = 1.0  # the best in the last, padded block
    got = jax.jit(_blocked_top_k, static_argnums=1)(jnp.asarray(x), k)
    want = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("ways", [False, True])
def test_the_gpu_search_finds_the_bisections_cutoffs(ways):
    # _search_ways (8 passes of 15 thresholds, what a GPU runs) against the bisection, on
    # top-k counts and top-p masses, rows with ties, -inf and an all-equal row.
    rng = np.random.default_rng(5)
    x = np.round(rng.normal(size=(5, 3000)) * 8).astype(np.float32) / 4
    x[1] = 0.5
    x[2, ::3] = -np.inf
    x = jnp.asarray(x)
    k = jnp.asarray([[1], [7], [300], [1000], [2999]], jnp.int32)
    w = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    target = jnp.asarray([[0.3], [0.9], [0.99], [0.5], [1e-6]]) * jnp.sum(w, -1, keepdims=True)
    count = lambda v: jnp.sum(x[:, None, :] >= v[:, :, None], axis=-1)
    mass = lambda v: jnp.sum(jnp.where(w[:, None, :] >= v[:, :, None], w[:, None, :], 0.0), -1)
    for fn, a, t in ((count, x, k), (mass, w, target)):
        lo = ops.sampling_cutoffs._to_ordered(jnp.min(a, axis=-1, keepdims=True))
        hi = ops.sampling_cutoffs._to_ordered(jnp.max(a, axis=-1, keepdims=True)) + 1
        search = ops.sampling_cutoffs._search_ways if ways else ops.sampling_cutoffs._bisect
        got = np.asarray(search(fn, lo, hi, t))
        want = np.asarray(ops.sampling_cutoffs._bisect(fn, lo, hi, t))
        np.testing.assert_array_equal(got, want)
        # the defining property: the largest value whose mass reaches the target
        assert (np.asarray(fn(jnp.asarray(got))) >= np.asarray(t)).all()
        above = np.nextafter(got, np.float32(np.inf))
        assert (np.asarray(fn(jnp.asarray(above))) < np.asarray(t)).all()


def test_the_sampler_is_the_same_as_a_gpu_runs_it(monkeypatch):
    # The whole step's sampler as a GPU runs it (top-k, top-p and top logprobs read off the
    # blocked top_k; the fallback cutoffs found by _search_ways) against the CPU's, on a
    # vocabulary where the blocks pay, with rows that take each fallback.
    vocab = BLOCK * 2 * CANDIDATES + 100
    params = MIXED + [dict(temperature=1.0, top_k=300), dict(temperature=1.0, top_p=0.99)]
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(len(params), vocab)) * 3,
                         jnp.float32)
    md = rows([metadata(1, vocab, **p) for p in params])
    md.seeds[:, 1] = 77 + np.arange(len(params))
    md.num_top_logprobs[:] = 5
    want = jax.jit(lambda x, md: sample(x, md))(logits, md)
    monkeypatch.setattr(ops.sampling, "top_k", _blocked_top_k)
    monkeypatch.setattr(ops.sampling_cutoffs, "_bisect", ops.sampling_cutoffs._search_ways)
    got = jax.jit(lambda x, md: sample(x, md))(logits, md)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert (np.asarray(got.top_ids) >= 0).all()  # the top logprobs were read off it too


# ---- 2-3. greedy rows, batch independence, reproducibility ----------------------------

MIXED = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.0, top_p=0.5),
         dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.8),
         dict(temperature=1.2, min_p=0.1), dict(temperature=0.0, top_k=3),
         dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02)]


def mixed_batch():
    logits = np.random.default_rng(1).normal(size=(len(MIXED), 64)).astype(np.float32)
    md = rows([metadata(1, 64, **p) for p in MIXED])
    md.seeds[:, 1] = 1000 + np.arange(len(MIXED))
    md.steps[:] = 7
    return logits, md


def test_greedy_rows_take_the_argmax():
    logits, md = mixed_batch()
    tokens = np.asarray(sample_jit(jnp.asarray(logits), md).token_ids)
    greedy = md.temperature == 0
    np.testing.assert_array_equal(tokens[greedy], logits[greedy].argmax(-1))


def test_each_row_draws_the_same_alone_and_anywhere_in_a_batch():
    logits, md = mixed_batch()
    batch = np.asarray(sample_jit(jnp.asarray(logits), md).token_ids)
    alone = [int(sample_jit(jnp.asarray(logits[s:s + 1]),
                            jax.tree.map(lambda a, s=s: a[s:s + 1], md)).token_ids[0])
             for s in range(len(MIXED))]
    np.testing.assert_array_equal(batch, alone)
    # Reversed, and next to rows with other seeds, steps and parameters.
    order = np.arange(len(MIXED))[::-1]
    _, other = mixed_batch()
    other.seeds[:, 1] += 50
    shuffled = rows([jax.tree.map(lambda a: a[order], md), other])
    both = np.concatenate([logits[order], -logits])
    got = np.asarray(sample_jit(jnp.asarray(both), shuffled).token_ids)[:len(MIXED)]
    np.testing.assert_array_equal(got, batch[order])


def test_steps_and_seeds_change_the_draw():
    flat = jnp.zeros((16, 64))
    md = metadata(16, 64, temperature=1.0)
    md.seeds[:] = seed_words(1234)
    md.steps[:] = np.arange(16)
    by_step = np.asarray(sample_jit(flat, md).token_ids)
    assert len(set(by_step)) >= 10  # 16 uniform draws from 64: ~14 distinct on average
    again = np.asarray(sample_jit(flat, md).token_ids)
    np.testing.assert_array_equal(by_step, again)
    md.steps[:] = 0
    md.seeds[:] = [seed_words(1234 + (s << 32)) for s in range(16)]  # only the high word differs
    by_seed = np.asarray(sample_jit(flat, md).token_ids)
    assert len(set(by_seed)) >= 10


def test_seed_words():
    assert seed_words(0) == (0, 0)
    assert seed_words(2**40 + 5) == (256, 5)
    assert seed_words(2**64 - 1) == (2**32 - 1, 2**32 - 1)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            seed_words(bad)


def test_threefry_gives_the_published_answers():
    """Random123's known answers for Threefry-2x32, 20 rounds: (key, counter) -> output."""
    known = [((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
             ((2**32 - 1,) * 2, (2**32 - 1,) * 2, (0x1CB996FC, 0xBB002BE7)),
             ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0))]
    for key, counter, out in known:
        got = jax.jit(threefry2x32)(*(jnp.asarray([v], jnp.uint32) for v in (*key, *counter)))
        assert [int(g[0]) for g in got] == list(out)


def test_row_uniforms_are_jax_randoms_draws_bit_for_bit():
    """Each row's uniform is jax.random.uniform of its seed's key folded with its step: seeded
    outputs are what they were with jax.random's own (slower to load and run) functions."""
    rng = np.random.default_rng(0)
    md = SamplingMetadata.dummy(4096, 1)
    md.seeds[:] = [seed_words(int(s)) for s in rng.integers(0, 2**63, 4096, dtype=np.int64)]
    md.seeds[:4] = [seed_words(0), seed_words(1), seed_words(2**32), seed_words(2**64 - 1)]
    md.steps[:] = rng.integers(0, 2**31, 4096)
    md.steps[:3] = [0, 1, 2**31 - 1]
    ours = np.asarray(jax.jit(row_uniforms)(jax.tree.map(jnp.asarray, md)))
    keys = jax.random.wrap_key_data(jnp.asarray(md.seeds), impl="threefry2x32")
    theirs = jax.jit(jax.vmap(lambda k, s: jax.random.uniform(jax.random.fold_in(k, s))))(
        keys, jnp.asarray(md.steps))
    np.testing.assert_array_equal(ours.view(np.uint32), np.asarray(theirs).view(np.uint32))
    assert ((ours >= 0) & (ours < 1)).all()


# ---- 4. penalties ---------------------------------------------------------------------


def test_penalties_match_vllm_formulas():
    vocab = 16
    rng = np.random.default_rng(2)
    logits = rng.normal(scale=2.0, size=(5, vocab)).astype(np.float32)
    prompt = np.array([[1, 2, 2, -1, -1], [3, 4, -1, -1, -1], [5, 6, 7, 8, -1],
                       [0, 9, 9, 9, 10], [-1] * 5], np.int32)
    output = np.array([[2, 11, 11, -1], [4, 4, 4, 12], [-1] * 4, [9, 13, 13, 0],
                       [14, 14, 15, -1]], np.int32)
    rep = np.array([1.0, 1.3, 2.0, 0.8, 1.0], np.float32)
    freq = np.array([0.0, 0.5, 0.0, -0.3, 1.0], np.float32)
    pres = np.array([0.0, 0.25, 0.0, 1.5, 0.0], np.float32)
    md = with_tokens(SamplingMetadata.dummy(5, vocab), output, prompt)
    md.repetition_penalty[:], md.frequency_penalty[:], md.presence_penalty[:] = rep, freq, pres
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), md))
    want = ref_penalties(logits, prompt, output, rep, freq, pres)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[0], logits[0])      # row 0 has every penalty off
    assert (got[2, 5:9] != logits[2, 5:9]).all()          # prompt-only tokens: repetition only


def test_penalties_off_leave_logits_alone_and_greedy_sees_them_on():
    logits = jnp.asarray(LOGITS[None])
    md = metadata(1, temperature=0.0)
    np.testing.assert_array_equal(apply_penalties(logits, md), logits)
    assert int(sample_jit(logits, md).token_ids[0]) == 1
    md = with_tokens(md, np.array([[1, 1]], np.int32))
    md.frequency_penalty[:] = 1.0  # token 1 drops from 2.0 to 0.0: token 5 (1.5) wins
    assert int(sample_jit(logits, md).token_ids[0]) == 5


# ---- 5-6. logprobs, and rows that must not produce NaN --------------------------------


def test_logprobs_are_raw_log_softmax_at_the_sampled_token():
    logits, md = mixed_batch()
    md.num_top_logprobs[:] = 5
    md = with_tokens(md, np.tile(np.array([[3, 4]], np.int32), (len(md.slots), 1)))
    md.repetition_penalty[:] = 1.5  # penalties and temperature must not touch the logprobs
    out = sample_jit(jnp.asarray(logits), md)
    ref = log_softmax64(logits)
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(len(tokens)), tokens], atol=2e-6)
    order = np.argsort(-ref, axis=-1)[:, :NUM_TOP_LOGPROBS]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1), atol=2e-6)
    assert (np.diff(np.asarray(out.top_logprobs), axis=-1) <= 0).all()


def test_rows_without_logprobs_get_nan_and_the_others_theirs():
    # Row 0 asked for no logprobs (-1), row 1 for its token's only (0), row 2 for the top 2.
    logits = np.stack([LOGITS, LOGITS[::-1], LOGITS])
    md = metadata(3, num_top_logprobs=np.array([-1, 0, 2], np.int32))
    out = sample_jit(jnp.asarray(logits), md)
    ref = log_softmax64(logits)
    tokens = np.asarray(out.token_ids)
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    assert np.isnan(out.logprobs[0])
    np.testing.assert_allclose(out.logprobs[1:], ref[[1, 2], tokens[1:]], atol=2e-6)
    assert (np.asarray(out.top_ids[:2]) == -1).all()
    np.testing.assert_array_equal(out.top_ids[2, :2], np.argsort(-LOGITS)[:2])
    # No row wants any: the log-softmax is skipped, the picks are the same.
    alone = sample_jit(jnp.asarray(logits), metadata(3))
    np.testing.assert_array_equal(alone.token_ids, tokens)
    assert np.isnan(alone.logprobs).all()


def test_top_logprobs_skipped_or_padded():
    out = sample_jit(jnp.asarray(LOGITS[None]), metadata(1))
    assert (np.asarray(out.top_ids) == -1).all() and np.isneginf(out.top_logprobs).all()
    out = sample_jit(jnp.asarray(LOGITS[None]), metadata(1, num_top_logprobs=3))
    np.testing.assert_array_equal(out.top_ids[0, :8], np.argsort(-LOGITS))
    assert (np.asarray(out.top_ids[0, 8:]) == -1).all()  # V = 8 < 20


def test_equal_logits_and_padding_rows_give_no_nan():
    vocab = 64
    params = [dict(), dict(temperature=1.0), dict(temperature=1.0, top_p=0.5),
              dict(temperature=1.0, top_k=3), dict(temperature=0.5, min_p=0.9),
              dict(temperature=1e-6, top_k=2, top_p=0.1, min_p=1.0), dict(temperature=100.0),
              dict(temperature=1.0, top_k=100, top_p=0.2)]
    md = rows([metadata(1, vocab, **p) for p in params] * 2)
    logits = np.zeros((len(md.temperature), vocab), np.float32)
    logits[len(params):, vocab // 2:] = -np.inf  # half the vocabulary masked by the engine
    md.num_top_logprobs[:] = 20
    out = sample_jit(jnp.asarray(logits), md)
    tokens = np.asarray(out.token_ids)
    assert ((tokens >= 0) & (tokens < vocab)).all()
    assert (tokens[len(params):] < vocab // 2).all()
    np.testing.assert_allclose(out.logprobs[:len(params)], -np.log(vocab), rtol=1e-6)
    np.testing.assert_allclose(out.logprobs[len(params):], -np.log(vocab // 2), rtol=1e-6)
    assert np.isfinite(out.top_logprobs).all()


# ---- 7. compilation -------------------------------------------------------------------


def test_new_parameter_values_do_not_recompile():
    logits, _ = mixed_batch()
    num_seqs = len(MIXED)
    for seed, params in enumerate([
            dict(), dict(temperature=1.0), dict(temperature=0.3, top_k=5),
            dict(temperature=1.0, top_p=0.9, min_p=0.1), dict(temperature=1.0, top_k=60),
            dict(temperature=0.5, repetition_penalty=1.2, presence_penalty=0.5,
                 frequency_penalty=0.1, num_top_logprobs=20)]):
        md = metadata(num_seqs, 64, **params)
        md.steps[:] = np.random.default_rng(seed).integers(0, 100, num_seqs)
        md = with_tokens(md, np.full((num_seqs, 1), seed, np.int32))
        jax.block_until_ready(sample_jit(jnp.asarray(logits), md))
    assert TRACES.count(jax.tree.map(jnp.shape, (logits, md))) == 1


def test_banned_tokens_are_never_picked_and_logprobs_stay_raw():
    # Row 0 greedy, row 1 sampled at a high temperature: token 1 (the argmax) and 5 banned.
    md = metadata(2, temperature=np.array([0.0, 2.0], np.float32), num_top_logprobs=0)
    md.banned_tokens[:, :2] = [1, 5]
    logits = np.stack([LOGITS, LOGITS])
    out = sample_jit(jnp.asarray(logits), md)
    assert int(out.token_ids[0]) == 3  # the best token that is not banned
    draws = sample_jit(jnp.asarray(np.tile(LOGITS, (DRAWS, 1))), rows(
        [metadata(DRAWS, temperature=2.0, banned_tokens=np.array([1, 5] + [-1] * 14))]))
    assert not np.isin(np.asarray(draws.token_ids), [1, 5]).any()
    np.testing.assert_allclose(np.asarray(out.logprobs[0]), log_softmax64(LOGITS)[3], rtol=1e-5)


def test_a_grammar_mask_limits_its_rows_only():
    # V = 40 (two mask words, the second partly past V). Row 0 greedy and row 1 sampled hot
    # follow a mask allowing {3, 33, 39}; row 2 is unconstrained and keeps its argmax even
    # though its mask words are zero.
    vocab = 40
    logits = np.tile(np.linspace(1.0, -1.0, vocab, dtype=np.float32), (3, 1))  # argmax: id 0
    md = metadata(3, vocab, temperature=np.array([0.0, 3.0, 0.0], np.float32),
                  constrained=np.array([1, 1, 0], np.int32), num_top_logprobs=0)
    for i in (3, 33, 39):
        md.token_mask[:2, i // 32] |= np.array(1 << (i % 32), np.uint32).view(np.int32)
    out = sample_jit(jnp.asarray(logits), md)
    assert int(out.token_ids[0]) == 3 and int(out.token_ids[2]) == 0
    many = metadata(DRAWS, vocab, temperature=3.0, constrained=1, token_mask=md.token_mask[0])
    draws = np.asarray(sample_jit(jnp.asarray(np.tile(logits[0], (DRAWS, 1))), many).token_ids)
    assert set(np.unique(draws)) == {3, 33, 39}
    # logprobs stay raw: the unmasked log-softmax at the picked token
    np.testing.assert_allclose(np.asarray(out.logprobs[0]), log_softmax64(logits[0])[3],
                               rtol=1e-5)
