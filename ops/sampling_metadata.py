"""What the step's sampler reads per row and what it returns: `SamplingMetadata` (every
per-request parameter a traced [S] array, so a new temperature never recompiles, and the
per-slot penalty tables the engine keeps on the device) and `SampleOutput`; each row's
seed and the uniform it draws with (`row_uniforms`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NUM_TOP_LOGPROBS = 20  # top logprobs computed per row; the engine slices to the requested N
MAX_BANNED = 16        # ids per row that min_tokens can keep from being picked
MAX_LOGIT_BIAS = 300   # logit_bias entries per row (engine/sampling_params.py says why)
MAX_BIAS = 100.0       # a bias of -MAX_BIAS bans its token, +MAX_BIAS makes it exclusive


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingMetadata:
    """One row per sequence; padding rows use `dummy` values (greedy, everything off)."""

    temperature: jax.Array         # [S] f32; 0 = greedy (argmax of the penalized logits)
    top_k: jax.Array               # [S] i32; 0 = off (values >= V are off too)
    top_p: jax.Array               # [S] f32; 1 = off
    min_p: jax.Array               # [S] f32; 0 = off
    presence_penalty: jax.Array    # [S] f32; 0 = off
    frequency_penalty: jax.Array   # [S] f32; 0 = off
    repetition_penalty: jax.Array  # [S] f32; 1 = off
    seeds: jax.Array               # [S, 2] u32: the row's 64-bit seed as (hi, lo), see seed_words
    steps: jax.Array               # [S] i32: tokens generated so far (the draw's counter)
    slots: jax.Array               # [S] i32: each row's row in the two tables below
    output_counts: jax.Array       # [N, V] i32: per slot, how often each id was generated
    prompt_mask: jax.Array         # [N, V] bool: per slot, the ids in the prompt
    num_top_logprobs: jax.Array    # [S] i32: the request's `logprobs`: -1 none (its logprob is
                                   # NaN), 0 its token's only, N the top N too; all < 1 skips
                                   # the top-20, all -1 the log-softmax
    banned_tokens: jax.Array       # [S, B] i32: ids the row may not pick now, padded with -1
                                   # (EOS and stop tokens before min_tokens is reached)
    logit_bias_ids: jax.Array      # [S, L] i32: the ids of the row's logit_bias, padded
                                   # with -1
    logit_bias: jax.Array          # [S, L] f32: their biases in [-100, 100] (0 on padding):
                                   # added to the logits the pick reads; -100 bans, +100
                                   # leaves only the row's +100 ids to pick from
    constrained: jax.Array         # [S] i32: 1 where the row follows a grammar (token_mask)
    token_mask: jax.Array          # [S, ceil(V / 32)] i32: packed allowed ids of the
                                   # constrained rows (bit i % 32 of word i // 32 is id i)

    @classmethod
    def dummy(cls, num_seqs: int, vocab_size: int = 1):
        """Host (numpy) arrays for `num_seqs` padding rows, row i on slot i of zeroed count
        tables. Tests fill rows in place; warmup can pass it as is."""
        s = num_seqs
        return cls(
            temperature=np.zeros(s, np.float32),
            top_k=np.zeros(s, np.int32),
            top_p=np.ones(s, np.float32),
            min_p=np.zeros(s, np.float32),
            presence_penalty=np.zeros(s, np.float32),
            frequency_penalty=np.zeros(s, np.float32),
            repetition_penalty=np.ones(s, np.float32),
            seeds=np.zeros((s, 2), np.uint32),
            steps=np.zeros(s, np.int32),
            slots=np.arange(s, dtype=np.int32),
            output_counts=np.zeros((s, vocab_size), np.int32),
            prompt_mask=np.zeros((s, vocab_size), bool),
            num_top_logprobs=np.full(s, -1, np.int32),
            banned_tokens=np.full((s, MAX_BANNED), -1, np.int32),
            logit_bias_ids=np.full((s, MAX_LOGIT_BIAS), -1, np.int32),
            logit_bias=np.zeros((s, MAX_LOGIT_BIAS), np.float32),
            constrained=np.zeros(s, np.int32),
            token_mask=np.zeros((s, -(-vocab_size // 32)), np.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    token_ids: jax.Array     # [S] i32
    logprobs: jax.Array      # [S] f32: raw log-softmax at token_ids
    top_ids: jax.Array       # [S, 20] i32: best first; -1 where skipped or V < 20
    top_logprobs: jax.Array  # [S, 20] f32: raw log-softmax at top_ids; -inf where skipped


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as the (hi, lo) uint32 words of `SamplingMetadata.seeds`: the same words
    as the key data of `jax.random.key(seed)` (threefry, x64 on, seed < 2^63)."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2^64), got {seed}")
    return seed >> 32, seed & 0xFFFFFFFF


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array,
                 x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block cipher (20 rounds; Salmon et al., "Parallel random numbers: as
    easy as 1, 2, 3", SC 2011) of counter (x0, x1) under key (k0, k1), elementwise over
    uint32 arrays: the function behind jax.random's default keys. Written out round by round
    so that XLA fuses it into one kernel (jax's own CPU lowering is a loop of five steps, ~25
    kernels, each resident memory once loaded and a dispatch per step)."""
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r)))
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def row_uniforms(md: SamplingMetadata) -> jax.Array:
    """[S] f32 in [0, 1), one per row, that depends only on the row's (seed, step): the same
    request draws the same token whatever else is in the batch and wherever its row sits.
    Bit for bit `jax.random.uniform(jax.random.fold_in(key, step))` with `key` the row's
    seed as threefry key data (jax's default, partitionable random bits)."""
    zero = jnp.zeros_like(md.seeds[:, 0])
    k0, k1 = threefry2x32(md.seeds[:, 0], md.seeds[:, 1], zero,
                          md.steps.astype(jnp.uint32))                      # fold_in(key, step)
    bits = jnp.bitwise_xor(*threefry2x32(k0, k1, zero, zero))             # random_bits(key, 32)
    one = np.array(1.0, np.float32).view(np.uint32)
    return lax.bitcast_convert_type((bits >> np.uint32(9)) | one, jnp.float32) - 1.0
