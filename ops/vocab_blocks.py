"""A vocabulary matrix (the embedding table, the LM head: one row per token) held as row
blocks, the first rows first: under int4 its FREQUENT_ROWS first rows in 8 bits and the
rest in int4. Splitting a matrix into its blocks, looking rows up (`embedding`) and the
logits over the blocks (`vocab_linear`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ops.quantization import dequantize
from ops.quantized_linear import linears

# Under int4, a vocabulary matrix keeps its FREQUENT_ROWS first rows in 8 bits (groups of 32,
# as llama.cpp's Q8_0) and holds the rest, parameter `name + RARE`, in int4. Tokenizers list
# their tokens most frequent first (BPE in merge order, SentencePiece by score), so the head's
# error falls on tokens rarely predicted. What the split costs in agreement and bytes:
# docs/performance-log.md, "int4's head: the frequent rows in 8 bits, the rest in 4".
FREQUENT_ROWS = 4096
RARE = "_rare"


def frequent_rows(vocab: int) -> int | None:
    """Where an int4 vocabulary matrix of `vocab` rows splits (see FREQUENT_ROWS); None: it
    is too small to split."""
    return FREQUENT_ROWS if vocab > FREQUENT_ROWS else None


def split_rows(w, rows: int) -> tuple:
    """A [V, E] float matrix, or its quantized parts, -> (its first `rows` rows, the rest)."""
    if isinstance(w, dict):
        return tuple({k: v[sl] for k, v in w.items()} for sl in (slice(rows), slice(rows, None)))
    return w[:rows], w[rows:]


def rows_of(w) -> int:
    return (w["q"] if isinstance(w, dict) else w).shape[0]


def vocab_linear(x: jax.Array, blocks: tuple, **kwargs) -> jax.Array:
    """x [T, I] times a vocabulary matrix held as row blocks (float or quantized, as `linear`
    takes them; the first rows first) -> [T, V] float32 logits: one product per block (one
    kernel call for all where ops/native's kernel takes them), joined."""
    ys = linears(x, list(blocks), out_dtype=jnp.float32, **kwargs)
    return ys[0] if len(ys) == 1 else jnp.concatenate(ys, -1)


def embedding(table, tokens: jax.Array, dtype, lanes: bool = False,
              cols: int | None = None) -> jax.Array:
    """Rows of a [V, E] float or quantized table, or of such a table held as row blocks (a
    tuple, the first rows first), -> [T, E] in `dtype`. `lanes`: packed 4-bit values are in
    ops/native's order (ops/quantized_linear.held_formats); `cols` (E): uint8 rows of E
    values are 8-bit ones in that kernel's order (ops/quantization.to_lanes8)."""
    if isinstance(table, tuple):
        out, start = None, 0
        for block in table:
            rows = rows_of(block)
            x = embedding(block, jnp.clip(tokens - start, 0, rows - 1), dtype, lanes, cols)
            out = x if out is None else jnp.where((tokens >= start)[:, None], x, out)
            start += rows
        return out
    if not isinstance(table, dict):
        return table[tokens]
    return dequantize(table["q"][tokens], table["scale"][tokens],
                      None if "min" not in table else table["min"][tokens], lanes=lanes,
                      cols=cols, dtype=dtype)
