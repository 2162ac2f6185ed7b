"""Single-sequence greedy decoding through the paged KV cache.

The plain path used by parity checks and tests: prefill the prompt in one step,
then one token per step. The engine's batched runner is the real serving path;
this one exists so the model can be checked against a reference on its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.llama import Llama
from models.run_options import LAYER_LOOPS, set_run_options
from models.sharding import kv_cache_sharding
from ops.attention import AttentionMetadata
from ops.kv_cache import KVCache, kv_storage_dtype
from ops.quantization import CHOICES


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


class GreedyDecoder:
    def __init__(self, model: Llama, *, max_len: int = 1024, page_size: int = 16,
                 kv_dtype=None):
        """`kv_dtype`: the KV pages' dtype (default: the model's compute dtype)."""
        cfg = model.cfg
        self.cfg, self.page_size = cfg, page_size
        self.num_pages = -(-max_len // page_size)
        self.max_len = self.num_pages * page_size
        self.graphdef, self.state = nnx.split(model)
        self.dtype = model.dtype
        self.kv_dtype = kv_storage_dtype(kv_dtype or model.dtype)
        self.kv_sharding = None if model.mesh is None else kv_cache_sharding(model.mesh)

        def step(state, tokens, positions, cache, md, logits_indices):
            m = nnx.merge(self.graphdef, state)
            return m(tokens, positions, cache, md, logits_indices)

        self._step = jax.jit(step, donate_argnums=(3,))

    def new_cache(self) -> KVCache:
        # Page 0 is the dummy page for padded rows; the sequence uses pages 1..num_pages.
        return KVCache.zeros(self.cfg.num_layers, self.num_pages + 1, self.page_size,
                             self.cfg.num_kv_heads, self.cfg.head_dim, self.kv_dtype,
                             self.kv_sharding)

    def run(self, cache: KVCache, tokens: list[int], start: int, all_logits: bool = False):
        """Append `tokens` (at positions start..) to the sequence; return logits and cache."""
        n = len(tokens)
        if start + n > self.max_len:
            raise ValueError(f"sequence of {start + n} tokens exceeds max_len {self.max_len}")
        t = _bucket(n) if n > 1 else 1
        pos = np.arange(start, start + n, dtype=np.int32)
        ids = np.zeros(t, np.int32)
        ids[:n] = tokens
        positions = np.zeros(t, np.int32)
        positions[:n] = pos
        slots = np.zeros(t, np.int32)  # padded rows write to page 0
        slots[:n] = (1 + pos // self.page_size) * self.page_size + pos % self.page_size
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots),
            query_start_loc=jnp.asarray([0, n], jnp.int32),
            kv_lens=jnp.asarray([start + n], jnp.int32),
            page_tables=jnp.arange(1, self.num_pages + 1, dtype=jnp.int32)[None, :],
            positions=jnp.asarray(positions),
            token_seq=jnp.asarray(np.where(np.arange(t) < n, 0, -1).astype(np.int32)),
        )
        idx = np.arange(t if all_logits else 1, dtype=np.int32) + (0 if all_logits else n - 1)
        logits, cache = self._step(self.state, jnp.asarray(ids), jnp.asarray(positions), cache,
                                   md, jnp.asarray(idx))
        return (np.asarray(logits[:n]) if all_logits else np.asarray(logits[0])), cache

    def prompt_logits(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens), V] float32 logits of a full forward pass."""
        logits, _ = self.run(self.new_cache(), tokens, 0, all_logits=True)
        return logits

    def _decode(self, prompt: list[int], n: int, pick) -> tuple[list[int], np.ndarray]:
        """The prompt prefilled in one pass, then n tokens decoded one at a time, token i being
        pick(i, the logits before it), as a server computes a continuation (a decode's products
        run where a lone row's run: the CPU kernel for quantized weights, not where a prompt's
        many rows do). Returns the tokens and the [n, V] logits before each."""
        logits, cache = self.run(self.new_cache(), prompt, 0)
        tokens, steps = [], []
        for i in range(n):
            steps.append(logits)
            tokens.append(pick(i, logits))
            if i + 1 < n:
                logits, cache = self.run(cache, [tokens[-1]], len(prompt) + i)
        return tokens, np.stack(steps)

    def decoded_logits(self, prompt: list[int], tokens: list[int]) -> np.ndarray:
        """[len(tokens), V] float32: the logits before each of `tokens`, teacher-forced."""
        return self._decode(prompt, len(tokens), lambda i, _: tokens[i])[1]

    def generate(self, prompt: list[int], max_new_tokens: int):
        """Greedy continuation; returns (new token ids, [max_new_tokens, V] logits)."""
        return self._decode(prompt, max_new_tokens, lambda _, logits: int(np.argmax(logits)))


def main(argv=None) -> int:
    import argparse
    import sys

    from models.chat_template import ChatTemplate
    from models.detokenizer import IncrementalDetokenizer
    from models.known_models import model_arg
    from models.loader import load_model
    from models.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(prog="python -m models.generate",
                                     description="Greedy generation with one model.")
    parser.add_argument("prompt")
    parser.add_argument("--model", help="GGUF file, HF directory or Orbax checkpoint, or a "
                                        "known model's name (default: SmolLM2-135M-Instruct; "
                                        "known models are fetched if missing)")
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--quantization", choices=CHOICES, default="auto",
                        help="weight-only quantization, as the server's (ops/quantization.py)")
    parser.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto",
                        help="how the layers loop, as the server's --layer-loop")
    args = parser.parse_args(argv)

    path = model_arg(args.model)
    tokenizer = Tokenizer.for_model(path)
    if args.raw or not tokenizer.chat_template:
        ids = tokenizer.encode(args.prompt)
    else:
        text = ChatTemplate.for_tokenizer(tokenizer).render(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
    model = load_model(path, dtype=args.dtype, quantization=args.quantization)
    set_run_options(model, layer_loop=args.layer_loop)
    decoder = GreedyDecoder(model, max_len=len(ids) + args.max_tokens)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids)
    cache = decoder.new_cache()
    logits, cache = decoder.run(cache, ids, 0)
    for i in range(args.max_tokens):
        token = int(np.argmax(logits))
        if token in tokenizer.eos_token_ids:
            break
        sys.stdout.write(detok.add(token))
        sys.stdout.flush()
        if i + 1 < args.max_tokens:
            logits, cache = decoder.run(cache, [token], len(ids) + i)
    sys.stdout.write(detok.flush() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
