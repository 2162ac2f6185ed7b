"""Smoothing before w8a8 (ops/quantization.py): move the activations' outlier channels into
the weights, as SmoothQuant does, so that one int8 scale per activation row loses less.

A row of activations is quantized with one scale, its largest |value| over 127; a few input
channels far larger than the rest leave the others a handful of levels. For each input
channel j of a matrix, with X_j the largest |activation| seen on a calibration text and W_j
the largest |weight| in that input column (over every matrix reading the same input),

    s_j = sqrt(X_j / W_j)        (SmoothQuant's alpha = 0.5; 0.3-0.8 measured worse here)

divides the input and multiplies the weight column. The division is folded into what
produces the input, so the float model computes the same function:
- q, k and v read the attention norm: its weight / s (the family's `scale_norm`);
- gate and up read the MLP norm: its weight / s;
- down reads act(gate) * up: up's rows / s;
- o reads the attention output: v's rows (and bias) / s, one s per KV head channel, shared
  by the query heads that read that head.
The LM head is left as it is (small models tie it to the embedding table).

The default model, teacher-forced against the float model (docs/performance.md): agreement
0.897 -> 0.936, KL 3.5e-2 -> 1.6e-2 (0.942 calibrated on another text). The calibration
text is ours (CALIBRATION_TEXT): a model's own tokens, nothing fetched.
"""

from __future__ import annotations

import contextvars

import jax
import numpy as np

from models.config import ModelConfig
from models.registry import model_class

ALPHA = 0.5
# Read by Llama.project while calibrating: (rows that are real, {matrix: [per layer maxima]}).
RECORDING: contextvars.ContextVar = contextvars.ContextVar("smoothing_recording", default=None)

CALIBRATION_TEXT = """\
The lighthouse keeper climbed the spiral stairs at dusk, as she had every evening for thirty
years. Below her the harbour emptied: fishing boats, a ferry bound for the islands, two
children racing a dog along the sea wall. She lit the lamp, wrote the time in the log (18:42),
and noted the wind: north-east, force 5, rising.

Q: What is the capital of Australia?
A: Canberra. Many people guess Sydney or Melbourne, but Canberra was chosen in 1908 as a
compromise between the two.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    \"\"\"Merge two sorted lists into one sorted list in O(len(a) + len(b)).\"\"\"
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

User: Can you summarise the causes of the French Revolution in three points?
Assistant: 1. A fiscal crisis: war debts and an unfair tax system left the state bankrupt.
2. Social tension between the privileged estates and the Third Estate. 3. Enlightenment
ideas that questioned absolute monarchy and inherited privilege.

{"id": 4211, "status": "shipped", "items": [{"sku": "A-17", "qty": 3, "price": 9.99}],
"total": 29.97, "currency": "EUR"}

La mer était calme ce matin-là. Der Zug fährt um 7 Uhr ab. El precio subió un 12 % en marzo.
東京は日本の首都です。 2 + 2 = 4; the integral of x^2 from 0 to 3 is 9.
"""


def _maxima(model, tokens: list[int]) -> dict[str, np.ndarray]:
    """{matrix name: [L, in] largest |input| per channel} over a forward pass of `tokens`."""
    from models.generate import GreedyDecoder

    seen: dict[str, list] = {}
    token = RECORDING.set((len(tokens), seen))
    try:  # traced here, so the step sends each matrix's input maxima back (`record`)
        GreedyDecoder(model, max_len=len(tokens)).prompt_logits(tokens)
    finally:
        RECORDING.reset(token)
    return {name: np.stack(per_layer) for name, per_layer in seen.items()}


def record(name: str, x) -> None:
    """Called by Llama.project for each matrix input: while a calibration pass is traced,
    the compiled step calls back with the input's largest |value| per channel, layer by
    layer in order."""
    state = RECORDING.get()
    if state is None:
        return
    rows, seen = state
    x_max = jax.numpy.max(jax.numpy.abs(x[:rows].astype(np.float32)), axis=0)
    jax.debug.callback(lambda m: seen.setdefault(name, []).append(np.asarray(m)), x_max,
                       ordered=True)


def _factor(x_max: np.ndarray, w_max: np.ndarray) -> np.ndarray:
    s = x_max ** ALPHA / np.maximum(w_max, 1e-8) ** (1 - ALPHA)
    return np.where(x_max > 0, np.clip(s, 1e-5, 1e5), 1.0).astype(np.float32)


def smooth(params: dict, cfg: ModelConfig, tokens: list[int]) -> dict:
    """Host float parameters (nested, models/weights.py) -> smoothed copies computing the same
    function, from the activations of `tokens` (the model's tokenization of
    CALIBRATION_TEXT)."""
    from models.weights import build_model

    dtype = params["embed"].dtype
    family = model_class(cfg.architecture)
    x_max = _maxima(build_model(cfg, params, dtype), tokens)
    layers = {name: np.array(w, np.float32) for name, w in params["layers"].items()}
    K, G, D = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    col_max = lambda names, i: np.max([np.abs(layers[n][i]).max(0) for n in names], axis=0)
    for i in range(cfg.num_layers):
        for norm, names in (("attn_norm", ("wq", "wk", "wv")), ("mlp_norm", ("w_gate", "w_up"))):
            s = _factor(x_max[names[0]][i], col_max(names, i))
            layers[norm][i] = family.scale_norm(layers[norm][i], s)
            for n in names:
                layers[n][i] *= s
        s = _factor(x_max["w_down"][i], col_max(["w_down"], i))
        layers["w_up"][i] /= s[:, None]
        layers["w_down"][i] *= s
        # o's input channel (query head h, d) is v's channel (h // G, d): one factor for each.
        x_o = x_max["wo"][i].reshape(K, G, D).max(1)
        w_o = np.abs(layers["wo"][i]).max(0).reshape(K, G, D).max(1)
        s = _factor(x_o, w_o)
        layers["wv"][i] /= s.reshape(-1)[:, None]
        if "bv" in layers:
            layers["bv"][i] /= s.reshape(-1)
        layers["wo"][i] *= np.repeat(s[:, None], G, axis=1).reshape(-1)
    out = dict(params)
    out["layers"] = {n: w.astype(params["layers"][n].dtype) for n, w in layers.items()}
    return out
