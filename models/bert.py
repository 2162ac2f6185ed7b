"""BERT encoders (HF `BertModel`, e.g. sentence-transformers' all-MiniLM-L6-v2): token ids
in, one pooled embedding per sequence out.

Absolute position embeddings plus token type 0, a LayerNorm over the embeddings, then
post-norm blocks (bidirectional self-attention, exact erf GELU). No KV cache: each call
encodes whole sequences, packed one after another into one token axis (as the decoders'
ragged steps pack theirs), each token attending to its own sequence's tokens only, so a
batch pays for its tokens and not for padding to its longest sequence. Plain functions over
a params pytree; every parameter is described once in `param_specs`, and the loader checks
each HF tensor's shape against it. Layers are stacked on a leading axis and run under
`lax.scan`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from models.hf_loader import safetensors_files
from models.parameters import ParamSpec
from models.pooling import PoolingConfig, pool, pooling_config
from models.weights import WeightError


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    architecture: str = "BertModel"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_dict(cls, hf: dict) -> EncoderConfig:
        # Only what this module computes: exact GELU and absolute positions.
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (supported: gelu)")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type "
                             f"{hf['position_embedding_type']!r} (supported: absolute)")
        return cls(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                   num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                   intermediate_size=hf["intermediate_size"],
                   max_position_embeddings=hf["max_position_embeddings"],
                   type_vocab_size=hf.get("type_vocab_size", 2),
                   layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                   architecture=(hf.get("architectures") or ["BertModel"])[0])


def param_specs(cfg: EncoderConfig) -> dict[str, ParamSpec]:
    """Our parameter names -> spec. `layers.*` carry a leading [L] axis."""
    L, E, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    vector = ParamSpec((L, E), ("layers", "embed"), "zeros")
    return {
        "word_embed": ParamSpec((cfg.vocab_size, E), ("vocab", "embed")),
        "position_embed": ParamSpec((cfg.max_position_embeddings, E), ("positions", "embed")),
        "type_embed": ParamSpec((cfg.type_vocab_size, E), ("token_types", "embed")),
        "embed_norm": ParamSpec((E,), ("embed",), "ones"),
        "embed_norm_bias": ParamSpec((E,), ("embed",), "zeros"),
        "layers.wq": ParamSpec((L, E, E), ("layers", "heads", "embed")),
        "layers.wk": ParamSpec((L, E, E), ("layers", "heads", "embed")),
        "layers.wv": ParamSpec((L, E, E), ("layers", "heads", "embed")),
        "layers.bq": ParamSpec((L, E), ("layers", "heads"), "zeros"),
        "layers.bk": ParamSpec((L, E), ("layers", "heads"), "zeros"),
        "layers.bv": ParamSpec((L, E), ("layers", "heads"), "zeros"),
        "layers.wo": ParamSpec((L, E, E), ("layers", "embed", "heads")),
        "layers.bo": vector,
        "layers.attn_norm": ParamSpec((L, E), ("layers", "embed"), "ones"),
        "layers.attn_norm_bias": vector,
        "layers.w_up": ParamSpec((L, F, E), ("layers", "mlp", "embed")),
        "layers.b_up": ParamSpec((L, F), ("layers", "mlp"), "zeros"),
        "layers.w_down": ParamSpec((L, E, F), ("layers", "embed", "mlp")),
        "layers.b_down": vector,
        "layers.mlp_norm": ParamSpec((L, E), ("layers", "embed"), "ones"),
        "layers.mlp_norm_bias": vector,
    }


# HF tensor names (after an optional `bert.` prefix) -> ours; per layer within
# `encoder.layer.{i}.`. Every matrix is [out, in], as HF stores it.
_TENSORS = {
    "embeddings.word_embeddings.weight": "word_embed",
    "embeddings.position_embeddings.weight": "position_embed",
    "embeddings.token_type_embeddings.weight": "type_embed",
    "embeddings.LayerNorm.weight": "embed_norm",
    "embeddings.LayerNorm.bias": "embed_norm_bias",
}
_LAYER_TENSORS = {
    "attention.self.query.weight": "wq", "attention.self.query.bias": "bq",
    "attention.self.key.weight": "wk", "attention.self.key.bias": "bk",
    "attention.self.value.weight": "wv", "attention.self.value.bias": "bv",
    "attention.output.dense.weight": "wo", "attention.output.dense.bias": "bo",
    "attention.output.LayerNorm.weight": "attn_norm",
    "attention.output.LayerNorm.bias": "attn_norm_bias",
    "intermediate.dense.weight": "w_up", "intermediate.dense.bias": "b_up",
    "output.dense.weight": "w_down", "output.dense.bias": "b_down",
    "output.LayerNorm.weight": "mlp_norm", "output.LayerNorm.bias": "mlp_norm_bias",
}


def load_params(directory: str | Path, cfg: EncoderConfig, dtype=jnp.float32) -> dict:
    """The model's safetensors as our pytree ({name: array, "layers": {name: [L, ...]}}),
    on the default device. A missing, surplus or misshapen tensor is an error naming it."""
    index = {}  # HF name without `bert.` -> (open file, its name there)
    for file in safetensors_files(directory):
        try:
            # The numpy backend cannot read bfloat16; the flax one can.
            f = safe_open(str(file), framework="flax")
        except (SafetensorError, OSError) as e:
            raise WeightError(f"{file}: cannot open safetensors file ({e})") from e
        index |= {name.removeprefix("bert."): (f, name) for name in f.keys()}
    wanted = dict(_TENSORS) | {f"encoder.layer.{i}.{hf}": f"layers.{ours}"
                               for i in range(cfg.num_layers)
                               for hf, ours in _LAYER_TENSORS.items()}
    surplus = [n for n in index if n.startswith(("embeddings.", "encoder."))
               and n not in wanted and n != "embeddings.position_ids"]
    if surplus:  # e.g. more layers than config.json says
        raise WeightError(f"{directory}: tensor {index[surplus[0]][1]} is not in a "
                          f"{cfg.num_layers}-layer {cfg.architecture}")
    specs = param_specs(cfg)
    host = {}
    cpu = jax.local_devices(backend="cpu")[0]
    for hf, ours in wanted.items():
        if hf not in index:
            raise WeightError(f"{directory}: tensor {hf} is missing")
        f, stored = index[hf]
        with jax.default_device(cpu):
            w = np.asarray(f.get_tensor(stored))
        shape = specs[ours].shape[1:] if ours.startswith("layers.") else specs[ours].shape
        if w.shape != shape:
            raise WeightError(f"{directory}: tensor {stored} has shape {w.shape}, expected "
                              f"{shape}")
        host.setdefault(ours, []).append(w)
    params = {"layers": {}}
    for ours, ws in host.items():
        if ours.startswith("layers."):
            params["layers"][ours.removeprefix("layers.")] = jnp.asarray(np.stack(ws), dtype)
        else:
            params[ours] = jnp.asarray(ws[0], dtype)
    return params


def _layer_norm(x, w, b, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def _linear(x, w, b):  # x [T, in], w [out, in], b [out]
    return jnp.einsum("TI,OI->TO", x, w) + b


def _layer(x, p, same_row, cfg: EncoderConfig):  # x [T, E]; same_row [T, T] bool
    T, E = x.shape
    N, D = cfg.num_heads, cfg.head_dim
    q, k, v = (_linear(x, p[w], p[b]).reshape(T, N, D)
               for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    scores = jnp.einsum("QND,KND->NQK", q, k, preferred_element_type=jnp.float32) * D ** -0.5
    # A key of another row (or padding) weighs exactly 0; a padding query stays finite.
    scores = jnp.where(same_row[None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    attn = jnp.einsum("NQK,KND->QND", probs, v).reshape(T, E)
    eps = cfg.layer_norm_eps
    x = _layer_norm(x + _linear(attn, p["wo"], p["bo"]), p["attn_norm"], p["attn_norm_bias"], eps)
    h = jax.nn.gelu(_linear(x, p["w_up"], p["b_up"]), approximate=False)
    return _layer_norm(x + _linear(h, p["w_down"], p["b_down"]), p["mlp_norm"],
                       p["mlp_norm_bias"], eps)


def hidden_states(params, tokens, lengths, *, cfg: EncoderConfig):
    """tokens int32 [T]: rows packed one after another from position 0 (row i's `lengths[i]`
    tokens right after row i-1's, padding after the last), lengths int32 [S] -> [T, E], the
    last layer's states (a row's tokens attend to their own row only; padding's states are
    not meaningful). No row may be longer than the position table."""
    T = tokens.shape[0]
    starts = jnp.cumsum(lengths) - lengths
    at = jnp.arange(T)
    # each token's row (S for padding) and its position in that row
    row = jnp.searchsorted(starts + lengths, at, side="right")
    positions = at - starts[jnp.minimum(row, lengths.shape[0] - 1)]
    positions = jnp.clip(positions, 0, cfg.max_position_embeddings - 1)
    x = (params["word_embed"][tokens] + params["position_embed"][positions]
         + params["type_embed"][0])
    x = _layer_norm(x, params["embed_norm"], params["embed_norm_bias"], cfg.layer_norm_eps)
    real = row < lengths.shape[0]
    same_row = (row[:, None] == row[None, :]) & real[None, :]  # [T, T]: query, key
    x, _ = jax.lax.scan(lambda x, p: (_layer(x, p, same_row, cfg), None), x, params["layers"])
    return x


def embed(params, tokens, lengths, *, cfg: EncoderConfig, pooling: PoolingConfig):
    """tokens int32 [T] (rows packed from position 0, as `hidden_states` takes them), lengths
    int32 [S] (0 for padding rows, which give a finite vector) -> float32 [S, E] pooled (and
    normalised when `pooling` says so)."""
    return pool(hidden_states(params, tokens, lengths, cfg=cfg), lengths, pooling)


@dataclasses.dataclass(frozen=True)
class Encoder:
    cfg: EncoderConfig
    params: dict              # load_params' pytree, on the default device
    pooling: PoolingConfig    # from the model's sentence-transformers files
    tokenizer: Tokenizer      # no padding or truncation; ids include [CLS] ... [SEP]
    # sentence_bert_config.json's max_seq_length where the files have one (256 for
    # all-MiniLM-L6-v2: the length it was trained on, where sentence-transformers truncates;
    # vLLM takes it as the model's length too), else the position table's length.
    max_model_len: int


def load_encoder(path: str | Path, dtype=jnp.float32) -> Encoder:
    """An HF BERT directory (config.json, model.safetensors, tokenizer.json, and
    sentence-transformers' modules.json for its pooling: mean, as sentence-transformers
    pools a plain model, without them)."""
    path = Path(path)
    file = path / "config.json"
    try:
        cfg = EncoderConfig.from_hf_dict(json.loads(file.read_text()))
    except FileNotFoundError:
        raise FileNotFoundError(f"{file}: no config.json in the model directory") from None
    except KeyError as e:
        raise ValueError(f"{file}: missing key {e}") from None
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path / 'tokenizer.json'}: the encoder's tokenizer is missing")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    max_len = cfg.max_position_embeddings
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        max_len = min(max_len, int(json.loads(st_config.read_text()).get("max_seq_length")
                                   or max_len))
    return Encoder(cfg, load_params(path, cfg, dtype), pooling_config(path), tokenizer, max_len)
