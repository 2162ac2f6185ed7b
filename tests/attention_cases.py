"""Randomized ragged paged attention cases and a float64 numpy oracle, shared by the
kernel tests (every kernel is checked against both the pure-JAX reference and the oracle).

A case is a ragged step over a small paged KV cache: sequences whose lengths end exactly
on and just past page boundaries, a sequence of length 1, padded query rows after the
real ones and a padded (empty) sequence, with pages handed out in random order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.attention import AttentionMetadata, row_layout
from ops.kv_cache import KVCache
from ops.reference_attention import ref_ragged_paged_attention

# The pure-JAX reference as one compiled program (op by op it takes ~3x longer a case, each
# small op compiled for every new shape).
reference = jax.jit(ref_ragged_paged_attention, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "block_kv", "block_rows"))

KINDS = ("decode", "prefill", "mixed")
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
NUM_LAYERS = 2
LAYER = 1


@dataclasses.dataclass
class Case:
    q: jnp.ndarray           # [T, H, D]
    cache: KVCache
    md: AttentionMetadata
    seqs: list[tuple[int, int]]  # (q_len, kv_len) per sequence, padding included

    @property
    def num_real_rows(self) -> int:
        return sum(q for q, _ in self.seqs)


def _lengths(kind: str, page_size: int, rng) -> list[tuple[int, int]]:
    """(q_len, kv_len) per sequence. Each kind has a length-1 sequence, lengths exactly on
    a page boundary and one past it, and a padded empty sequence at the end."""
    p = page_size
    if kind == "decode":
        kv = [1, p, p + 1, 2 * p, int(rng.integers(2, 3 * p))]
        seqs = [(1, n) for n in kv]
    elif kind == "prefill":
        kv = [1, p, p + 1, int(rng.integers(2, 2 * p))]
        seqs = [(n, n) for n in kv]
    elif kind == "mixed":
        seqs = [
            (1, 2 * p),                 # decode ending on a boundary
            (p, 2 * p),                 # chunked prefill: second chunk ends on a boundary
            (3, p + 1),                 # chunk ending one past a boundary
            (1, 1),                     # a sequence of length 1
            (int(rng.integers(2, p)), int(rng.integers(p, 3 * p))),  # random chunk
            (1, int(rng.integers(2, 3 * p))),  # random decode
        ]
    else:
        raise ValueError(kind)
    return seqs + [(0, 0)]


def slots_of(page_tables, seqs, page_size: int, num_tokens: int) -> np.ndarray:
    """Each query row's KV slot (its K/V are in the cache already, as after `write_kv`);
    padded rows point at page 0."""
    slots = np.zeros(num_tokens, np.int32)
    row = 0
    for s, (q_len, kv_len) in enumerate(seqs):
        for pos in range(kv_len - q_len, kv_len):
            slots[row] = page_tables[s, pos // page_size] * page_size + pos % page_size
            row += 1
    return slots


def make_case(kind: str, *, num_kv_heads: int, group: int, head_dim: int, page_size: int,
              dtype=jnp.float32, seed: int = 0, pad_rows: int = 5) -> Case:
    rng = np.random.default_rng(seed)
    seqs = _lengths(kind, page_size, rng)
    pages_per_seq = [-(-kv // page_size) for _, kv in seqs]
    max_pages = max(pages_per_seq) + 1  # a spare column: unused entries point at page 0
    num_pages = sum(pages_per_seq) + 3  # the dummy page 0 and two never-used pages
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_tables = np.zeros((len(seqs), max_pages), np.int32)
    for s, n in enumerate(pages_per_seq):
        for j in range(n):
            page_tables[s, j] = free.pop()

    num_tokens = sum(q for q, _ in seqs) + pad_rows
    query_start_loc = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    shape = (NUM_LAYERS, num_pages, page_size, num_kv_heads, head_dim)
    cache = KVCache(jnp.asarray(rng.standard_normal(shape), dtype),
                    jnp.asarray(rng.standard_normal(shape), dtype))
    q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), dtype)
    kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    positions, token_seq = row_layout(jnp.asarray(query_start_loc), kv_lens, num_tokens)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots_of(page_tables, seqs, page_size, num_tokens)),
        query_start_loc=jnp.asarray(query_start_loc),
        kv_lens=kv_lens,
        page_tables=jnp.asarray(page_tables),
        positions=positions, token_seq=token_seq,
    )
    return Case(q, cache, md, seqs)


def case_of(seqs: list[tuple[int, int]], *, num_kv_heads: int, group: int, head_dim: int,
            page_size: int, seed: int = 0, pad_rows: int = 3) -> Case:
    """A float32 step of exactly these (q_len, kv_len) sequences, pages in random order and
    page tables just wide enough."""
    rng = np.random.default_rng(seed)
    pages = [-(-kv // page_size) for _, kv in seqs]
    num_pages = sum(pages) + 1  # and the dummy page 0
    free = list(rng.permutation(np.arange(1, num_pages)))
    tables = np.zeros((len(seqs), max(pages)), np.int32)
    for s, n in enumerate(pages):
        tables[s, :n] = [free.pop() for _ in range(n)]
    num_tokens = sum(q for q, _ in seqs) + pad_rows
    shape = (NUM_LAYERS, num_pages, page_size, num_kv_heads, head_dim)
    query_start_loc = jnp.asarray(np.cumsum([0] + [q for q, _ in seqs]), jnp.int32)
    kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    positions, token_seq = row_layout(query_start_loc, kv_lens, num_tokens)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots_of(tables, seqs, page_size, num_tokens)),
        query_start_loc=query_start_loc, kv_lens=kv_lens, page_tables=jnp.asarray(tables),
        positions=positions, token_seq=token_seq)
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim))
    return Case(jnp.asarray(q, jnp.float32),
                KVCache(*(jnp.asarray(rng.standard_normal(shape), jnp.float32)
                          for _ in range(2))), md, seqs)


def oracle(q, cache: KVCache, layer: int, md: AttentionMetadata, *, sm_scale: float,
           sliding_window: int | None = None, soft_cap: float | None = None) -> np.ndarray:
    """Ragged paged attention in float64 numpy, one sequence and one row at a time."""
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    q, k_pages, v_pages = f64(q), f64(cache.k[layer]), f64(cache.v[layer])
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = q.shape[1] // num_kv_heads
    qsl, kv_lens, tables = (np.asarray(x) for x in (md.query_start_loc, md.kv_lens,
                                                    md.page_tables))
    out = np.zeros_like(q)
    for s, kv_len in enumerate(kv_lens):
        start, end = int(qsl[s]), int(qsl[s + 1])
        if end == start:
            continue
        pages = tables[s, :-(-kv_len // page_size)]
        k = k_pages[pages].reshape(-1, num_kv_heads, k_pages.shape[-1])[:kv_len]
        v = v_pages[pages].reshape(-1, num_kv_heads, v_pages.shape[-1])[:kv_len]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [kv_len, H, D]
        for i, row in enumerate(range(start, end)):
            pos = kv_len - (end - start) + i
            lo = 0 if sliding_window is None else max(pos - sliding_window + 1, 0)
            logits = np.einsum("hd,lhd->hl", q[row], k[lo:pos + 1]) * sm_scale
            if soft_cap is not None:
                logits = soft_cap * np.tanh(logits / soft_cap)
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[row] = np.einsum("hl,lhd->hd", p, v[lo:pos + 1])
    return out


def rel_err(out, expected) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(out - expected)) / np.max(np.abs(expected)))


def check_kernel(kernel, case: Case, *, layer: int = LAYER, values: KVCache | None = None,
                 blocks: dict | None = None, **kw) -> None:
    """Run `kernel` (the reference's signature) on `case` and hold it to the reference and the
    float64 oracle: relative error under the dtype's tolerance, no NaN, padded rows zero.
    `values`: the float pages the oracle reads when `case.cache` stores them otherwise (int8
    with scales, fp8); `blocks`: the kernel's own block sizes; `kw`: attention options."""
    sm_scale = case.q.shape[-1] ** -0.5
    out = kernel(case.q, case.cache, layer, case.md, sm_scale=sm_scale, **(blocks or {}), **kw)
    ref = reference(case.q, case.cache, layer, case.md, sm_scale=sm_scale, **kw)
    values = case.cache if values is None else values
    expected = oracle(case.q, values, layer, case.md, sm_scale=sm_scale, **kw)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype, (out.shape, out.dtype)
    out_np = np.asarray(jnp.asarray(out, jnp.float32))
    assert not np.isnan(out_np).any()
    tol = TOLERANCE[jnp.dtype(case.q.dtype).name]
    assert rel_err(out, expected) < tol, ("oracle", rel_err(out, expected))
    assert rel_err(out, ref.astype(jnp.float32)) < tol, ("reference", rel_err(out, ref))
    np.testing.assert_array_equal(out_np[case.num_real_rows:], 0.0)


def _matrix() -> list[dict]:
    """GQA ratio x head dim x page size x dtype in full (24 cases), with the batch kind
    cycling so every kind meets every value of each of the others."""
    product = [(g, d, p, t) for g in (1, 4, 8) for d in (64, 128) for p in (16, 64)
               for t in ("float32", "bfloat16")]
    return [dict(kind=KINDS[i % 3], group=g, head_dim=d, page_size=p, dtype=t,
                 num_kv_heads=2, seed=i) for i, (g, d, p, t) in enumerate(product)]


_FACTORS = ("kind", "group", "head_dim", "page_size", "dtype")


def _pairs(params: dict) -> set:
    values = [(f, params[f]) for f in _FACTORS]
    return {(a, b) for i, a in enumerate(values) for b in values[i + 1:]}


def _pairwise(matrix: list[dict]) -> list[dict]:
    """A subset of `matrix` in which every pair of values of two factors still meets (greedy:
    each pick covers the most pairs not yet met). Interpret-mode kernels take ~2 s a case on
    the 2-core CPU, so the default suite runs these and the slow run the whole matrix."""
    missing = set().union(*(_pairs(c) for c in matrix))
    chosen = []
    while missing:
        best = max(matrix, key=lambda c: len(_pairs(c) & missing))
        chosen.append(best)
        missing -= _pairs(best)
    return chosen


def _each_value(matrix: list[dict]) -> list[dict]:
    """A subset of `matrix` in which every value of every factor occurs (greedy, as above)."""
    missing = {(f, c[f]) for c in matrix for f in _FACTORS}
    chosen = []
    while missing:
        best = max(matrix, key=lambda c: len({(f, c[f]) for f in _FACTORS} & missing))
        chosen.append(best)
        missing -= {(f, best[f]) for f in _FACTORS}
    return chosen


# Parameter sets for `make_case`, each with a readable id for pytest.
MATRIX = _matrix()
MATRIX_IDS = [f"{c['kind']}-g{c['group']}-d{c['head_dim']}-p{c['page_size']}-{c['dtype']}"
              for c in MATRIX]
PAIRWISE = _pairwise(MATRIX)
EACH_VALUE = _each_value(PAIRWISE)


def _params(default: list[dict]) -> list:
    return [pytest.param(c, id=name, marks=() if c in default else pytest.mark.slow)
            for c, name in zip(MATRIX, MATRIX_IDS, strict=True)]


# The matrix for pytest.mark.parametrize: the pairwise cases by default, the rest slow; the
# Pallas kernels, interpreted on the CPU (~5 s a case), take every value once by default.
MATRIX_PARAMS = _params(PAIRWISE)
INTERPRETED_MATRIX_PARAMS = _params(EACH_VALUE)


def case_from(params: dict) -> Case:
    params = dict(params)
    return make_case(params.pop("kind"), dtype=jnp.dtype(params.pop("dtype")), **params)
