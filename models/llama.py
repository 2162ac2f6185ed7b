"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) in Flax NNX, and the base
class of the other families (models/registry.py).

Every parameter is described once in `param_specs` (shape, logical axes, init:
models/parameters.py); the module, the abstract shapes used by the loaders and the
weight-name maps all derive from that table. Layers are stacked on a leading axis and run in
one loop (`lax.fori_loop`), so compile time does not grow with depth; layers of different kinds
(Gemma 3's sliding and full ones) loop a period of kinds at a time. The forward
pass is one ragged batch of tokens over the paged KV cache (ops/attention.py, ops/kv_cache.py).
XLA:GPU copies a float weight sliced at a loop index before its product and reads a constant
slice in place, so `--layer-loop` can unroll the layers (`unroll_layers`: slow to compile on
a big model), or keep the scan and hand each float matrix's product the whole stack and the
layer index (`stacked_kernel`: ops/pallas_gpu_matmul reads it in place).

A family differs from Llama by overriding the class methods that describe its
parameters and tensor names, and the steps of `layer` (`qk_norm`, `mlp`, or `layer`
itself); shared layers stay here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.parameters import (
    ParamSpec,
    init_param,
    quantized_specs,
    vocab_matrix,
    weight,
    whole_matrices,
)
from models.rope import apply_rope, rope_inv_freq
from models.smoothing import record
from ops.attention import AttentionMetadata, ragged_paged_attention, resolve_backend
from ops.attention import prepare as prepare_attention
from ops.cpu_linear import FULL_X_BITS, runs_native
from ops.invariant import mean_square
from ops.kv_cache import KVCache, write_kv
from ops.quantization import QuantFormat
from ops.quantized_linear import linear, linears, stacked
from ops.vocab_blocks import embedding, vocab_linear

# llama.cpp's tensor names within `blk.{i}.` -> HF's within `model.layers.{i}.` (Llama).
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class _Stack(nnx.Module):
    """The per-layer parameters, each with a leading [L] axis."""

    def __init__(self, params: dict[str, nnx.Param]):
        for name, p in params.items():
            setattr(self, name, p)


class Llama(nnx.Module):
    # ---- what the loaders ask of a family (class methods: no instance needed) ---------

    @classmethod
    def float_specs(cls, cfg: ModelConfig) -> dict[str, ParamSpec]:
        """Our parameter names -> spec, every matrix in float. `layers.*` carry a leading
        [L] axis."""
        L, E, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        specs = {
            "embed": ParamSpec((V, E), ("vocab", "embed")),
            "layers.attn_norm": ParamSpec((L, E), ("layers", "embed"), "ones"),
            "layers.wq": ParamSpec((L, H * D, E), ("layers", "heads", "embed")),
            "layers.wk": ParamSpec((L, K * D, E), ("layers", "kv_heads", "embed")),
            "layers.wv": ParamSpec((L, K * D, E), ("layers", "kv_heads", "embed")),
            "layers.wo": ParamSpec((L, E, H * D), ("layers", "embed", "heads")),
            "layers.mlp_norm": ParamSpec((L, E), ("layers", "embed"), "ones"),
            "layers.w_gate": ParamSpec((L, F, E), ("layers", "mlp", "embed")),
            "layers.w_up": ParamSpec((L, F, E), ("layers", "mlp", "embed")),
            "layers.w_down": ParamSpec((L, E, F), ("layers", "embed", "mlp")),
            "final_norm": ParamSpec((E,), ("embed",), "ones"),
        }
        if cfg.attention_bias:
            specs["layers.bq"] = ParamSpec((L, H * D), ("layers", "heads"), "zeros")
            specs["layers.bk"] = ParamSpec((L, K * D), ("layers", "kv_heads"), "zeros")
            specs["layers.bv"] = ParamSpec((L, K * D), ("layers", "kv_heads"), "zeros")
        if not cfg.tie_word_embeddings:
            specs["lm_head"] = ParamSpec((V, E), ("vocab", "embed"))
        return specs

    @classmethod
    def param_specs(cls, cfg: ModelConfig, quant: dict[str, QuantFormat] | None = None
                    ) -> dict[str, ParamSpec]:
        """`float_specs`, where a matrix quantized as `quant[name]` becomes `name` (integer
        values), `name_scale` and maybe `name_min`."""
        return quantized_specs(cls.float_specs(cfg), quant)

    @classmethod
    def layer_tensors(cls, cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
        """HF tensor name within `model.layers.{i}.` -> (our layer parameter, shape)."""
        E, F = cfg.hidden_size, cfg.intermediate_size
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tensors = {
            "input_layernorm.weight": ("attn_norm", (E,)),
            "self_attn.q_proj.weight": ("wq", (H * D, E)),
            "self_attn.k_proj.weight": ("wk", (K * D, E)),
            "self_attn.v_proj.weight": ("wv", (K * D, E)),
            "self_attn.o_proj.weight": ("wo", (E, H * D)),
            "post_attention_layernorm.weight": ("mlp_norm", (E,)),
            "mlp.gate_proj.weight": ("w_gate", (F, E)),
            "mlp.up_proj.weight": ("w_up", (F, E)),
            "mlp.down_proj.weight": ("w_down", (E, F)),
        }
        if cfg.attention_bias:
            tensors |= {
                "self_attn.q_proj.bias": ("bq", (H * D,)),
                "self_attn.k_proj.bias": ("bk", (K * D,)),
                "self_attn.v_proj.bias": ("bv", (K * D,)),
            }
        return tensors

    @classmethod
    def gguf_layer_names(cls) -> dict[str, str]:
        """llama.cpp's tensor name within `blk.{i}.` -> HF's within `model.layers.{i}.`."""
        return dict(_GGUF_LAYER)

    @classmethod
    def from_gguf(cls, hf_name: str, w):
        """A tensor as llama.cpp's converter stored it -> as HF has it (float arrays only;
        quantized blocks pass through `from_gguf` only if the family changes nothing)."""
        return w

    @classmethod
    def scale_norm(cls, w, s):
        """A norm weight whose output is divided by `s` (models/smoothing.py)."""
        return w / s

    # ---- the module --------------------------------------------------------------------

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str = "reference", mesh=None,
                 quant: dict[str, QuantFormat] | None = None):
        self.cfg = cfg
        self.dtype = dtype  # activations (and float weights)
        self.quant = tuple(sorted((quant or {}).items()))  # (parameter name, format) pairs
        # w8a8: every matrix is per-channel int8; its matmuls read int8 rows (ops/quantized_linear)
        self.int8_activations = any(fmt.activations == 8 for fmt in (quant or {}).values())
        self.attention_backend = resolve_backend(attention_backend)  # "auto" -> the platform's
        self.mesh = mesh  # a tensor-parallel mesh (models/sharding.py), or None
        # Quantized weight-only matmuls of a few float32 rows run in xlaserve's CPU kernel
        # (ops/native) on one CPU device; elsewhere XLA's dot.
        self.native_matmuls = runs_native(dtype, quant or {}, sharded=mesh is not None)
        # Packed 4-bit values in that kernel's order (ops/quantized_linear.held_formats: where
        # it runs them), all of them or none; and 8-bit ones where it multiplies bytes.
        orders = {f.lanes for f in (quant or {}).values() if f.packed}
        if len(orders) > 1:
            raise ValueError("packed 4-bit weights are held in one order")
        self.lanes = any(f.lanes for f in (quant or {}).values())
        # How it runs, as models.run_options.set_run_options sets it for whoever runs it:
        # the layers unrolled, or looped with float and per-channel int8 matrices handed
        # whole to ops/pallas_gpu_matmul; batch-invariant rows; the dtype of XLA's many-row
        # products (None: the model's); the bits x keeps in ops/native's 4-bit products.
        self.unroll_layers = False
        self.stacked_kernel = False
        self.batch_invariant = False
        self.wide_dtype = None
        self.x_bits = FULL_X_BITS
        params = {name: nnx.Param(init_param(spec, rngs.params(), dtype))
                  for name, spec in self.param_specs(cfg, quant).items()}
        self.top_names = tuple(n for n in params if not n.startswith("layers."))
        for name in self.top_names:  # embed, final_norm, lm_head (and their quantization parts)
            setattr(self, name, params.pop(name))
        self.layers = _Stack({name.removeprefix("layers."): p for name, p in params.items()})

    def __call__(
        self,
        tokens: jax.Array,      # [T] int32
        positions: jax.Array,   # [T] int32
        cache: KVCache,
        md: AttentionMetadata,
        logits_indices: jax.Array | None = None,  # [N] rows whose logits are wanted
    ) -> tuple[jax.Array, KVCache]:  # logits [T or N, V] float32
        x, cache = self.hidden_states(tokens, positions, cache, md, logits_indices)
        return self.logits(x), cache

    def hidden_states(
        self,
        tokens: jax.Array,      # [T] int32
        positions: jax.Array,   # [T] int32
        cache: KVCache,
        md: AttentionMetadata,
        logits_indices: jax.Array | None = None,  # [N] rows whose states are wanted
    ) -> tuple[jax.Array, KVCache]:  # final-normed states [T or N, E]
        """The model body: embeddings and every layer, updating the cache."""
        cfg = self.cfg
        top = self.top_params()
        # The residual stream stays float32 between layers (as llama.cpp's does); each norm
        # hands its sublayer the compute dtype. In bfloat16 that keeps the sum of 30-odd
        # layers from rounding at every add (the default model's teacher-forced agreement
        # with transformers' float32 tokens: 0.978 with a bfloat16 stream).
        x = self.embed_tokens(top, tokens).astype(jnp.float32)  # [T, E]
        layer_params = nnx.to_pure_dict(nnx.state(self.layers))
        kinds = tuple(LayerKind(cfg.layer_window(i), cfg.rope_local_theta is not None
                                and cfg.layer_window(i) is not None)
                      for i in range(cfg.num_layers))
        md = prepare_attention(md, backend=self.attention_backend, num_tokens=tokens.shape[0],
                               num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
        step = _Step(positions, md, {kind: rope_inv_freq(cfg, kind.local_rope)
                                     for kind in set(kinds)})
        period = _period(kinds)

        at = functools.partial(self.layer_params, layer_params)
        if period == 1 or self.unroll_layers:
            def layer(carry, idx):  # idx: a Python int when unrolled (any period)
                kind = kinds[idx] if isinstance(idx, int) else kinds[0]
                return self.layer(*carry, at(idx), jnp.asarray(idx, jnp.int32), kind, step)

            x, cache = self.over_layers(layer, (x, cache))
        else:
            # A period of layer kinds per iteration, each layer with its kind's static
            # window and RoPE; the layers past the last whole period follow the loop.
            def group(carry, g):
                for j in range(period):
                    idx = g * period + j
                    carry = self.layer(*carry, at(idx), idx, kinds[j], step)
                return carry, None

            groups = cfg.num_layers // period
            x, cache = jax.lax.fori_loop(0, groups, lambda g, c: group(c, g)[0], (x, cache))
            for idx in range(groups * period, cfg.num_layers):
                x, cache = self.layer(x, cache, at(idx), jnp.int32(idx), kinds[idx], step)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.norm(x, top["final_norm"]), cache

    def over_layers(self, fn, carry):
        """carry = fn(carry, idx) for every layer in order: in a loop with idx its traced
        counter (`lax.fori_loop`: a scan over a list of ids made XLA:GPU slice the id out
        of it each layer, a launch of its own outside the layer's command buffer), or
        unrolled with idx a Python int (`unroll_layers`), which `layer_params` slices at a
        constant index."""
        if self.unroll_layers:
            for idx in range(self.cfg.num_layers):
                carry = fn(carry, idx)
            return carry
        return jax.lax.fori_loop(0, self.cfg.num_layers, lambda idx, c: fn(c, idx), carry)

    def layer_params(self, stack: dict, idx) -> dict:
        """Layer `idx`'s parameters from the stacked ones: each sliced, except the matrices
        that go whole with the index (`whole_matrices`: quantized ones under the CPU kernel;
        float and per-channel int8 ones under `stacked_kernel`, scanned)."""
        whole = whole_matrices(stack, native=self.native_matmuls,
                               kernel=self.stacked_kernel and not isinstance(idx, int),
                               int8_activations=self.int8_activations)
        parts = {n + suffix for n in whole for suffix in ("_scale", "_min")}
        take = ((lambda a: a[idx]) if isinstance(idx, int)  # unrolled: a constant slice
                else (lambda a: jax.lax.dynamic_index_in_dim(a, idx, 0, False)))
        p = {n: take(a) for n, a in stack.items() if n not in whole and n not in parts}
        p.update({n: stacked(weight(stack, n), idx) for n in whole})
        return p

    # ---- the steps a family may override -----------------------------------------------

    def embed_tokens(self, top: dict, tokens: jax.Array) -> jax.Array:
        return embedding(vocab_matrix(top, "embed"), tokens, self.dtype, self.lanes,
                         self.cfg.hidden_size)

    def norm(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x (the float32 stream, or a sublayer's output) normed, in the compute dtype."""
        return rms_norm(x, w, self.cfg.rms_norm_eps).astype(self.dtype)

    def layer(self, x, cache, p, idx, kind: LayerKind, step: _Step):
        """One decoder layer: (x, cache) -> (x, cache)."""
        attn, cache = self.attention(self.norm(x, p["attn_norm"]), cache, p, idx, kind, step)
        x = x + attn
        return x + self.mlp(self.norm(x, p["mlp_norm"]), p), cache

    def qk_norm(self, q: jax.Array, k: jax.Array, p: dict):
        """[T, H, D] and [T, K, D] before RoPE (Llama: nothing)."""
        return q, k

    def attention(self, h, cache, p, idx, kind: LayerKind, step: _Step):
        """Self-attention over the paged cache, output projection included."""
        cfg = self.cfg
        T, H, K, D = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = self.projects(h, p, ("wq", "wk", "wv"))
        if cfg.attention_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q, k, v = q.reshape(T, H, D), k.reshape(T, K, D), v.reshape(T, K, D)
        q, k = self.qk_norm(q, k, p)
        inv_freq = step.inv_freq[kind]
        q = apply_rope(q, step.positions, inv_freq)
        k = apply_rope(k, step.positions, inv_freq)
        cache = write_kv(cache, idx, k, v, step.md.slot_mapping, mesh=self.mesh)
        attn = ragged_paged_attention(
            q, cache, idx, step.md, sm_scale=cfg.sm_scale, sliding_window=kind.window,
            backend=self.attention_backend, mesh=self.mesh, batch_invariant=self.batch_invariant)
        return self.project(attn.reshape(T, H * D), p, "wo"), cache

    def mlp(self, h, p):
        gate, up = self.projects(h, p, ("w_gate", "w_up"))
        return self.project(self.activation(gate) * up, p, "w_down")

    def activation(self, x):
        return jax.nn.silu(x)

    def project(self, x, p, name: str):
        """x times the layer's matrix `name` (its input is recorded while calibrating)."""
        return self.projects(x, p, (name,))[0]

    def projects(self, x, p, names: tuple[str, ...]) -> list:
        """x times each of the layer's matrices `names`, inputs recorded while calibrating (one
        kernel call for all where the CPU kernel runs them: q, k and v at one token read 3
        matrices with 2 threads in one go)."""
        for name in names:
            record(name, x)
        return linears(x, [weight(p, name) for name in names], **self._matmul_options())

    def linear(self, x, w, out_dtype=None):
        return linear(x, w, out_dtype, **self._matmul_options())

    def _matmul_options(self) -> dict:
        """How this model's matmuls run (ops.quantized_linear.linear's keyword arguments)."""
        return dict(chunked=self.mesh is None, int8_activations=self.int8_activations,
                    native=self.native_matmuls, any_rows=self.batch_invariant,
                    wide_dtype=self.wide_dtype, x_bits=self.x_bits, lanes=self.lanes)

    # ---- the head ----------------------------------------------------------------------

    def logits(self, x: jax.Array, head: tuple | None = None) -> jax.Array:
        """The LM head: [N, E] final-normed -> [N, V] float32; `head` as `head()` gives it
        (default: this model's)."""
        head = self.head(self.top_params()) if head is None else head
        return vocab_linear(x, head, **self._matmul_options())

    def head(self, top: dict) -> tuple:
        """The LM head as `vocab_linear` takes it, from `top_params()`."""
        return vocab_matrix(top, "embed" if self.cfg.tie_word_embeddings else "lm_head")

    def top_params(self) -> dict:
        """The parameters outside the layer stack (embeddings, final norm, LM head)."""
        return {name: getattr(self, name)[...] for name in self.top_names}


Model = Llama  # what models/registry.py asks a family module for


def config_fields(hf: dict | None = None, gguf: dict | None = None) -> dict:
    """The family's own ModelConfig fields: none beyond the shared ones."""
    return {}


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What a layer's attention needs as static values: its window and its RoPE table."""

    window: int | None
    local_rope: bool


@dataclasses.dataclass(frozen=True)
class _Step:
    """Per call, what every layer reads: positions, metadata, RoPE tables by layer kind."""

    positions: jax.Array
    md: AttentionMetadata
    inv_freq: dict


def _period(kinds: tuple) -> int:
    """The shortest p with kinds[i] == kinds[i % p] for all i."""
    return next(p for p in range(1, len(kinds) + 1)
                if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As in HF: normalise in float32, cast back, then scale. The mean in a fixed order: a
    # row's norm must not depend on how many rows share the step (ops/invariant.py).
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(mean_square(xf) + eps)
    return weight * xf.astype(x.dtype)
