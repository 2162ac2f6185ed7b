"""Sampling inside the compiled step: penalties, temperature, top-k / min-p / top-p, a
seeded draw per row, and the raw logprobs the API reports.

Every per-request parameter is a traced [S] array in `SamplingMetadata`
(ops/sampling_metadata.py), so a new temperature never recompiles. Semantics follow vLLM
v1: penalties -> (greedy rows take the argmax here) -> temperature -> min-p -> top-k ->
top-p -> draw; logprobs are the log-softmax of the raw logits (vLLM's default
`raw_logprobs`).

Costs at S=64, V=49152 on a 2-core CPU: this whole call for greedy rows costs
less than a plain jnp.argmax of the logits there (docs/performance-log.md, "Engine, offline
bench"). No filter sorts the vocabulary (a sort of that shape costs far more than all of
this); each is a per-row logit cutoff. Top-k and top-p read theirs off the 64 best tokens
(one top_k) and fall back to an exact search, costlier than the top_k, only when some row
needs more (ops/sampling_cutoffs.py: how each runs on a CPU and on a GPU). The draw is an
inverse CDF with ONE uniform per row, over block masses then one block: a Gumbel draw needs
S*V random numbers, which cost more there than the whole greedy call (the sort, top_k,
bisection and Gumbel costs were measured on the 2-core CPU; docs/performance.md).
Penalties read per-slot tables the engine keeps on the device (`output_counts`, bumped by
`count_sampled` after each draw; `prompt_mask`, set by `reset_slot` at admission), so no
token lists travel per step. Work no row asks for is skipped by a `lax.cond` on a batch-wide
predicate: penalties (two [S, V] gathers), the draw itself (all greedy), top-k/top-p, the
bisections, the top-20 logprobs, the log-softmax (when no row asked for logprobs). That
holds on CPU only (`_skip_unless`): on a GPU or TPU a conditional on device data makes the
host wait for its predicate, so there the work runs unconditionally (each skipped branch
equals the full one when no row asks for its work).
Under `vmap` a cond becomes a select and runs both branches: call these on the whole batch.
Ids banned before `min_tokens`, a grammar's packed token mask (the `constrained` rows'
`token_mask`, engine/grammar.py) and OpenAI's `logit_bias` (`_bias`: added after the ban and
the mask, before the penalties, as vLLM orders them; -100 bans, +100 is exclusive) change the
pick only, so logprobs stay the model's own.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ops.sampling_cutoffs import (
    BLOCK,
    _bisect_top_k,
    _bisect_top_p,
    _blocks,
    top_k,
)
from ops.sampling_metadata import (
    MAX_BIAS,
    NUM_TOP_LOGPROBS,
    SampleOutput,
    SamplingMetadata,
    row_uniforms,
)

CANDIDATES = 64        # best tokens from which top-k / top-p cutoffs are read without bisection


def _skip_unless(pred: jax.Array, full: Callable, skipped: Callable, *operands):
    """`full(*operands)`, or `skipped(*operands)` when the batch-wide `pred` is false, which
    must give the same result when no row asks for the work `full` does. A `lax.cond` on CPU;
    elsewhere `full` unconditionally, since a cond on device data is a host sync per step on
    GPU (chosen per lowering platform, so an export for cuda on a CPU host has no cond)."""
    return lax.platform_dependent(
        *operands, cpu=lambda *ops: lax.cond(pred, full, skipped, *ops), default=full)


# ---- penalties ------------------------------------------------------------------------


def token_counts(tokens: jax.Array, vocab_size: int) -> jax.Array:
    """[..., N] ids padded with -1 -> [..., V] i32 occurrence counts."""
    flat = tokens.reshape(-1, tokens.shape[-1])
    rows = jnp.arange(flat.shape[0])[:, None]
    ids = jnp.where(flat >= 0, flat, vocab_size)  # out of range -> dropped
    counts = jnp.zeros((flat.shape[0], vocab_size), jnp.int32).at[rows, ids].add(1, mode="drop")
    return counts.reshape(*tokens.shape[:-1], vocab_size)


def reset_slot(output_counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array,
               prompt: jax.Array, output: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A slot's tables counted afresh from its prompt and output ids so far ([L] each, padded
    with -1): what a sequence with penalties brings when it takes a slot."""
    vocab_size = output_counts.shape[1]
    return (output_counts.at[slot].set(token_counts(output, vocab_size)),
            prompt_mask.at[slot].set(token_counts(prompt, vocab_size) > 0))


def count_sampled(output_counts: jax.Array, slots: jax.Array,
                  token_ids: jax.Array) -> jax.Array:
    """Each row's sampled id counted in its slot (S scattered adds; rows on a shared spare
    slot count there harmlessly)."""
    return output_counts.at[slots, token_ids].add(1, mode="drop")


def _penalize(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    out_counts = md.output_counts[md.slots]                            # [S, V]
    seen = md.prompt_mask[md.slots] | (out_counts > 0)
    r = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return (logits - md.frequency_penalty[:, None] * out_counts
            - md.presence_penalty[:, None] * (out_counts > 0))


def _penalties_active(md: SamplingMetadata) -> jax.Array:
    return (jnp.any(md.repetition_penalty != 1) | jnp.any(md.frequency_penalty != 0)
            | jnp.any(md.presence_penalty != 0))


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """vLLM's penalties on [S, V] logits: repetition over prompt + output tokens (positive
    logits divided by r, negative ones multiplied), then frequency (f * count) and presence
    (p * [count > 0]) over output tokens only. Skipped when no row uses any of them."""
    return _skip_unless(_penalties_active(md), _penalize, lambda x, _: x, logits, md)


# ---- filters: each one is a per-row threshold found without sorting (sampling_cutoffs) -


def _argmax(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """First index of the row maximum, and the maximum: [S] i32, [S, 1] f32. Two levels
    (block maxima, then one block): XLA:CPU's flat argmax at [64, 49152] is much slower than
    this (docs/performance-log.md, "Engine, offline bench")."""
    blocks = _blocks(x, -jnp.inf)                                              # [S, B, D]
    block_max = jnp.max(blocks, axis=-1)                                       # [S, B]
    b = jnp.argmax(block_max, axis=-1)
    block = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]        # [S, D]
    ids = (b * BLOCK + jnp.argmax(block, axis=-1)).astype(jnp.int32)
    return ids, jnp.take_along_axis(block_max, b[:, None], axis=-1)

def _weights(x: jax.Array, x_max: jax.Array, md: SamplingMetadata,
             cutoff: jax.Array | None = None) -> jax.Array:
    """p / p_max of softmax(x / T) for x of shape [S, ...] (exactly 1 at the argmax), 0 below
    min-p and below the logit cutoff. Greedy rows get T = 1 so that nothing divides by 0;
    their weights are never used."""
    def row(v):  # [S] or [S, 1] -> broadcastable against x
        return v.reshape(v.shape[0], *[1] * (x.ndim - 1))

    temperature = jnp.where(md.temperature > 0, md.temperature, 1.0)
    w = jnp.exp((x - row(x_max)) / row(temperature))
    keep = w >= row(md.min_p)
    if cutoff is not None:
        keep &= x >= row(cutoff)
    return jnp.where(keep, w, 0.0)


def _top_k_top_p(x: jax.Array, x_max: jax.Array, md: SamplingMetadata) -> jax.Array:
    """[S, 1] logit cutoff: keeping x >= cutoff applies top-k, then top-p over the
    renormalised survivors of top-k and min-p. Ties at the cutoff are all kept.

    Both cutoffs are read off the CANDIDATES best tokens (one lax.top_k); a row whose top_k
    exceeds them or whose nucleus is wider falls back to an exact bisection, costlier than
    the top_k at [64, 49152] on CPU (measured on the 2-core CPU; docs/performance.md), that
    runs only when such a row exists. Which path a row takes depends on the row alone, so
    batch composition never changes its draw.
    The cutoff is a logit, not a weight, so that the caller's recomputed weights cannot
    disagree with it by a rounding.
    """
    sampled = md.temperature > 0  # greedy rows never trigger a bisection
    vocab_size = x.shape[1]
    num_candidates = min(CANDIDATES, vocab_size)
    values, ids = top_k(x, num_candidates)                                     # [S, C]

    k_on = ((md.top_k > 0) & (md.top_k < vocab_size))[:, None]
    k = jnp.where(k_on[:, 0], md.top_k, 1)[:, None].astype(jnp.int32)          # [S, 1]
    k_fits = k <= num_candidates
    k_cut = jnp.take_along_axis(values, jnp.minimum(k, num_candidates) - 1, axis=-1)
    k_cut = _skip_unless(jnp.any(sampled[:, None] & k_on & ~k_fits),
                         lambda c: jnp.where(k_fits, c, _bisect_top_k(x, k)), lambda c: c, k_cut)
    k_cut = jnp.where(k_on, k_cut, -jnp.inf)
    w = _weights(x, x_max, md, k_cut)                                          # [S, V]

    # Kept iff the mass above the token in sorted order is < top_p (vLLM's rule): the
    # cutoff is the first token whose inclusive cumulative mass reaches top_p.
    p_on = (md.top_p < 1)[:, None]
    target = md.top_p[:, None] * jnp.sum(w, axis=-1, keepdims=True)           # [S, 1]
    best = jnp.take_along_axis(w, ids, axis=-1)                                # [S, C] desc
    n = jnp.sum(jnp.cumsum(best, axis=-1) < target, axis=-1, keepdims=True)
    p_fits = n < num_candidates
    p_cut = jnp.take_along_axis(values, jnp.minimum(n, num_candidates - 1), axis=-1)

    def bisect(p_cut):
        w_cut = _bisect_top_p(w, target)
        x_cut = jnp.min(jnp.where(w >= w_cut, x, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(p_fits, p_cut, x_cut)

    p_cut = _skip_unless(jnp.any(sampled[:, None] & p_on & ~p_fits), bisect, lambda c: c, p_cut)
    return jnp.maximum(k_cut, jnp.where(p_on, p_cut, -jnp.inf))


def _no_cutoff(x: jax.Array, *_) -> jax.Array:
    return jnp.full((x.shape[0], 1), -jnp.inf)


def _first_above(cdf: jax.Array, t: jax.Array, weight: jax.Array) -> jax.Array:
    """[S] index of the first positive-weight entry whose cdf exceeds t ([S, 1]); the last
    positive one when rounding leaves t at or above the end; -1 if the row is all zero."""
    iota = lax.broadcasted_iota(jnp.int32, cdf.shape, 1)
    first = jnp.min(jnp.where((cdf > t) & (weight > 0), iota, cdf.shape[1]), axis=-1)
    last = jnp.max(jnp.where(weight > 0, iota, -1), axis=-1)
    return jnp.where(first < cdf.shape[1], first, last)


def _draw(x: jax.Array, weights_of: Callable[[jax.Array], jax.Array],
          u: jax.Array) -> jax.Array:
    """Inverse CDF: [S] index drawn with one uniform u ([S]) per row from the weights
    `weights_of(x)` (elementwise, any [S, ...] shape) of x ([S, V]). Two levels (block
    masses, then one block) because a full [64, 49152] cumsum is much slower on CPU than this
    (measured on the 2-core CPU; docs/performance.md); the weights are recomputed for the
    chosen block rather than materialised."""
    blocks = _blocks(x, -jnp.inf)                                              # [S, B, D]
    mass = jnp.sum(weights_of(blocks), axis=-1)                                # [S, B]
    cdf = jnp.cumsum(mass, axis=-1)
    t = u[:, None] * cdf[:, -1:]                                               # [S, 1]
    b = jnp.maximum(_first_above(cdf, t, mass), 0)
    before = jnp.take_along_axis(cdf, jnp.maximum(b - 1, 0)[:, None], axis=-1)
    t = t - jnp.where(b[:, None] > 0, before, 0.0)
    inner = weights_of(jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0])  # [S, D]
    i = _first_above(jnp.cumsum(inner, axis=-1), t, inner)
    return jnp.where(i >= 0, b * BLOCK + i, -1)


def _sample_random(x: jax.Array, x_max: jax.Array, md: SamplingMetadata) -> jax.Array:
    """[S] i32 drawn from softmax(x / T) after min-p, top-k and top-p (vLLM v1's order; top-k
    and min-p commute, top-p sees the renormalised survivors of both). -1 where nothing is
    left to draw, which only NaN logits cause: the argmax survives every filter."""
    cutoff = _skip_unless(jnp.any((md.temperature > 0) & ((md.top_k > 0) | (md.top_p < 1))),
                          _top_k_top_p, _no_cutoff, x, x_max, md)              # [S, 1]
    u = row_uniforms(md)                                                       # [S]
    return _draw(x, lambda xs: _weights(xs, x_max, md, cutoff), u)


def _pick(x: jax.Array, md: SamplingMetadata) -> jax.Array:
    """[S] token ids from penalized logits x: argmax for greedy rows, a draw for the rest."""
    greedy_ids, x_max = _argmax(x)
    sampled_ids = _skip_unless(jnp.any(md.temperature > 0), _sample_random,
                               lambda *_: jnp.full_like(greedy_ids, -1), x, x_max, md)
    return jnp.where((md.temperature > 0) & (sampled_ids >= 0), sampled_ids, greedy_ids)


# ---- the step's sampler ---------------------------------------------------------------


def probs(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """[S, V] f32: the distribution each row of `sample` draws from (one-hot at the argmax for
    greedy rows). Materialises [S, V], which the step's sampler avoids: for tests and for
    consumers of the whole distribution (e.g. speculative decoding)."""
    x = apply_penalties(logits.astype(jnp.float32), md)
    greedy_ids, x_max = _argmax(x)
    w = _weights(x, x_max, md, _top_k_top_p(x, x_max, md))
    one_hot = jax.nn.one_hot(greedy_ids, x.shape[1], dtype=jnp.float32)
    return jnp.where((md.temperature > 0)[:, None], w / jnp.sum(w, axis=-1, keepdims=True),
                     one_hot)


def _top_logprobs(logits: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    k = min(NUM_TOP_LOGPROBS, logits.shape[1])
    values, ids = top_k(logits, k)                                           # [S, k]
    pad = [(0, 0), (0, NUM_TOP_LOGPROBS - k)]
    return (jnp.pad(ids, pad, constant_values=-1),
            jnp.pad(values - lse, pad, constant_values=-jnp.inf))


def _no_top_logprobs(logits: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    shape = (logits.shape[0], NUM_TOP_LOGPROBS)
    return jnp.full(shape, -1, jnp.int32), jnp.full(shape, -jnp.inf, jnp.float32)


def sample(logits: jax.Array, md: SamplingMetadata) -> SampleOutput:
    """Pick one token per row of [S, V] logits. Greedy rows (temperature 0) take the argmax
    of the penalized logits; the others draw with their row's uniform (see row_uniforms)."""
    if logits.ndim != 2 or md.temperature.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [S, V] with S = {md.temperature.shape} rows of "
                         f"metadata, got {logits.shape}")
    logits = logits.astype(jnp.float32)

    # Raw logprobs: log-softmax before penalties and temperature, for the rows that want them
    # (its sum of V exps is most of a lone greedy row's sampling time).
    wants = md.num_top_logprobs >= 0
    lse = _skip_unless(jnp.any(wants), lambda x: jax.nn.logsumexp(x, axis=-1, keepdims=True),
                       lambda x: jnp.zeros_like(x[:, :1]), logits)
    top_ids, top_logprobs = _skip_unless(jnp.any(md.num_top_logprobs > 0), _top_logprobs,
                                         _no_top_logprobs, logits, lse)
    wants_top = (md.num_top_logprobs > 0)[:, None]  # rows that asked for none: -1 / -inf
    top_ids = jnp.where(wants_top, top_ids, -1)
    top_logprobs = jnp.where(wants_top, top_logprobs, -jnp.inf)

    # Banned ids (min_tokens), a grammar's mask (its rows only) and logit_bias change the
    # pick only; logprobs stay raw. A row whose every id is banned picks id 0: the engine
    # bans at most MAX_BANNED + MAX_LOGIT_BIAS ids, so only a tiny vocabulary, or a grammar
    # whose every allowed id logit_bias bans (the grammar then ends the reply,
    # engine/grammar.advance), gets there. The common case, none of these nor a penalty in
    # any row, picks from the logits in place: a cond that returned [S, V] logits would copy
    # them (~3 ms a step at 64 rows). The other case picks once, from the logits modified:
    # each copy of the pick is ~85 more kernels, ~6.5 MiB resident once loaded, in every head.
    modified = (jnp.any(md.banned_tokens >= 0) | jnp.any(md.constrained != 0)
                | jnp.any(md.logit_bias_ids >= 0) | _penalties_active(md))
    token_ids = _skip_unless(modified, lambda x, md: _pick(_modify(x, md), md), _pick,
                             logits, md)
    logprobs = (jnp.take_along_axis(logits, token_ids[:, None], axis=-1) - lse)[:, 0]
    logprobs = jnp.where(wants, logprobs, jnp.nan)
    return SampleOutput(token_ids, logprobs, top_ids, top_logprobs)


def _modify(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """The logits `_pick` picks from: banned ids, grammar masks, logit biases and penalties
    applied, each skipped when no row has it."""
    x = _skip_unless(jnp.any(md.banned_tokens >= 0), _ban, lambda x, _: x, logits,
                     md.banned_tokens)
    x = _skip_unless(jnp.any(md.constrained != 0), _allow, lambda x, *_: x, x, md.token_mask,
                     md.constrained)
    x = _skip_unless(jnp.any(md.logit_bias_ids >= 0), _bias, lambda x, *_: x, x,
                     md.logit_bias_ids, md.logit_bias)
    return apply_penalties(x, md)


def _bias(logits: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
    """OpenAI's logit_bias on [S, V] logits, ids and biases [S, L] (ids padded with -1): each
    bias added to its id's logit, except the two ends, which are exact rather than large:
    -100 sets -inf (never drawn, as a ban), and +100, which OpenAI describes as "exclusive
    selection", leaves only the row's +100 ids that are not already banned or masked to pick
    from (each at its logit + 100, so the model still ranks them). A plain +100 would lose to
    a frequency penalty or a temperature spreading the draw. Rows without an id stay bit for
    bit. A gather, one elementwise pass (it fuses) and a scatter of L entries: no [S, V]
    table of biases."""
    vocab_size = logits.shape[1]
    rows = jnp.arange(logits.shape[0])[:, None]
    valid = (ids >= 0) & (ids < vocab_size)
    at = jnp.take_along_axis(logits, jnp.where(valid, ids, 0), axis=1)        # [S, L]
    forced = valid & (bias >= MAX_BIAS) & (at > -jnp.inf)
    exclusive = jnp.any(forced, axis=1, keepdims=True)                         # [S, 1]
    new = jnp.where((bias <= -MAX_BIAS) | (exclusive & ~forced), -jnp.inf, at + bias)
    x = jnp.where(exclusive, -jnp.inf, logits)
    return x.at[rows, jnp.where(valid, ids, vocab_size)].set(new, mode="drop")


def _allow(logits: jax.Array, token_mask: jax.Array, constrained: jax.Array) -> jax.Array:
    """-inf at the ids a constrained row's packed mask leaves out."""
    num_seqs, vocab_size = logits.shape
    bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(num_seqs, -1)[:, :vocab_size] != 0
    return jnp.where((constrained[:, None] != 0) & ~allowed, -jnp.inf, logits)


def _ban(logits: jax.Array, banned: jax.Array) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(banned >= 0, banned, logits.shape[1])  # -1 padding -> out of range, dropped
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")
