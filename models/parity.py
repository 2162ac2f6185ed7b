"""Parity against Hugging Face transformers (PyTorch, CPU, float32) on the same weights.

    python -m models.parity --model PATH --prompts FILE --max-tokens N
    python -m models.parity ... --quantization int4 [--min-agreement 0.93]
    python -m models.parity ... --save-reference ref.json      # where transformers runs
    python -m models.parity ... --reference ref.json --dtype bfloat16   # where it does not

Prompt file: one prompt per line. A line may be plain text, a JSON string (for
newlines and escapes), or a JSON object {"messages": [...]} rendered with the
model's chat template. Both sides get the same token ids.

Float32 (the default): we decode greedily, and at the first position where the
tokens differ we look at the reference's logits there: a divergence is accepted
only when our token is the reference's runner-up and its top-2 gap is below 1e-3
(a near-tie that float rounding can flip). Exit code 0 only if every prompt passes.

--quantization int8|int4|w8a8, --kv-cache-dtype, --dtype or --cpu-activation-dtype int8:
such a model cannot match token for token, so we measure how close it comes. The reference
decodes greedily; our model is teacher-forced on the prompt plus the reference's tokens (the
prompt in one pass, then each token decoded alone, as the server decodes: a quantized
model's products run where a decode runs them, the CPU kernel included) and we report, per
prompt and on average, the top-1 agreement (fraction of positions where our argmax is the
reference's token) and the mean KL(ref || ours) of the next-token distributions, then one
line `PARITY {json}` for scripts. Exit code 1 if the mean agreement is below
--min-agreement.

--save-reference FILE writes the reference's greedy token ids per prompt (JSON, no
logits) and stops; --reference FILE reads them instead of running transformers, so a
machine without it (or without a network) can measure agreement. A saved reference has
no logits: it gives agreement but no KL, and cannot judge greedy parity's near-ties.
Exit code 2 if the file was made for other prompt ids or another --max-tokens.

Needs the `dev` extra (torch, transformers, accelerate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import numpy as np

from models.chat_template import ChatTemplate
from models.generate import GreedyDecoder
from models.known_models import model_arg
from models.loader import load_model, model_format
from models.run_options import LAYER_LOOPS, set_run_options
from models.tokenizer import Tokenizer
from ops.cpu_linear import X_BITS
from ops.quantization import SCHEMES
from ops.xla_linear import WIDE_DTYPES

GAP_TOLERANCE = 1e-3


@dataclasses.dataclass
class ParityResult:
    prompt_tokens: int
    ours: list[int]
    ref: list[int]
    position: int | None = None   # first divergent new-token index, None if identical
    gap: float | None = None      # reference top-2 logit gap there
    max_logit_diff: float = 0.0   # over the steps before the divergence

    @property
    def passed(self) -> bool:
        if self.position is None:
            return True
        return self.gap is not None and self.gap < GAP_TOLERANCE

    def describe(self) -> str:
        if self.position is None:
            return (f"match ({len(self.ours)} tokens, max |dlogit| "
                    f"{self.max_logit_diff:.2e})")
        verdict = "near-tie, accepted" if self.passed else "FAIL"
        return (f"diverges at new token {self.position}: ours {self.ours[self.position]} vs "
                f"ref {self.ref[self.position]}, ref top-2 gap {self.gap:.3e} ({verdict})")


def load_reference(path: str | Path):
    """The transformers model for a GGUF file or HF directory, float32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if model_format(path) == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    elif model_format(path) == "hf":
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        raise ValueError(f"{path}: the reference loads GGUF files and HF directories only")
    return model.eval()


def reference_greedy(model, prompt: list[int], max_new_tokens: int):
    """Greedy decoding with transformers' KV cache; returns (tokens, [N, V] step logits)."""
    import torch

    out, steps, past = [], [], None
    inputs = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            res = model(inputs, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float().numpy()
            steps.append(logits)
            token = int(np.argmax(logits))
            out.append(token)
            inputs = torch.tensor([[token]])
    return out, np.stack(steps)


def compare(decoder: GreedyDecoder, ref_model, prompt: list[int], max_new_tokens: int):
    ours, our_logits = decoder.generate(prompt, max_new_tokens)
    ref, ref_logits = reference_greedy(ref_model, prompt, max_new_tokens)
    result = ParityResult(len(prompt), ours, ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        # Logits are comparable only while both sides have the same prefix.
        result.max_logit_diff = max(result.max_logit_diff,
                                    float(np.max(np.abs(our_logits[i] - ref_logits[i]))))
        if a != b:
            top2 = np.sort(ref_logits[i])[-2:]
            runner_up = int(np.argsort(ref_logits[i])[-2])
            result.position = i
            result.gap = float(top2[1] - top2[0]) if a == runner_up else float("inf")
            break
    return result


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def agreement_and_kl(ours: np.ndarray, ref_tokens: list[int],
                     ref_logits: np.ndarray | None) -> tuple[float, float | None]:
    """Over N positions ([N, V] logits each side): (fraction where our argmax is the
    reference's token, mean KL(ref || ours) in nats, None without the reference's logits)."""
    if len(ref_tokens) != len(ours) or (ref_logits is not None
                                        and ours.shape != ref_logits.shape):
        raise ValueError(f"logits {ours.shape} vs reference "
                         f"{None if ref_logits is None else ref_logits.shape} "
                         f"with {len(ref_tokens)} tokens")
    agreement = float(np.mean(np.argmax(ours, axis=-1) == np.asarray(ref_tokens)))
    if ref_logits is None:
        return agreement, None
    log_p, log_q = log_softmax(ref_logits), log_softmax(ours)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)  # [N]
    return agreement, float(kl.mean())


@dataclasses.dataclass
class AgreementResult:
    prompt_tokens: int
    positions: int
    agreement: float  # top-1 agreement with the reference's greedy tokens
    kl: float | None  # mean KL(ref || ours), nats; None from a saved reference

    def describe(self) -> str:
        return (f"top-1 agreement {self.agreement:.4f} "
                f"({round(self.agreement * self.positions)}/{self.positions}), "
                f"mean KL {describe_kl(self.kl)}")


def describe_kl(kl: float | None) -> str:
    return "not available (saved reference: no logits)" if kl is None else f"{kl:.3e}"


def compare_teacher_forced(decoder: GreedyDecoder, prompt: list[int], ref: list[int],
                           ref_logits: np.ndarray | None = None) -> AgreementResult:
    """Our model on the prompt plus the reference's new tokens `ref` (and its [N, V]
    logits for them, when we have them)."""
    ours = decoder.decoded_logits(prompt, ref)  # [N, V]: row i predicts ref[i]
    return AgreementResult(len(prompt), len(ref), *agreement_and_kl(ours, ref, ref_logits))


def check_greedy(decoder: GreedyDecoder, ref_model, prompts: list[list[int]],
                 max_new_tokens: int) -> int:
    failed = 0
    for i, prompt in enumerate(prompts):
        result = compare(decoder, ref_model, prompt, max_new_tokens)
        failed += not result.passed
        print(f"prompt {i} ({result.prompt_tokens} tokens): {result.describe()}", flush=True)
    print(f"{len(prompts) - failed}/{len(prompts)} prompts pass")
    return 1 if failed else 0


def check_agreement(decoder: GreedyDecoder, prompts: list[list[int]], references,
                    min_agreement: float | None, settings: dict) -> int:
    """`references`: per prompt, (new token ids, [N, V] logits or None), from the live
    model (computed as they are asked for) or a saved file. `settings` (our dtype and
    such) goes into the closing PARITY line."""
    results = []
    for i, (prompt, (ref, ref_logits)) in enumerate(zip(prompts, references, strict=True)):
        results.append(compare_teacher_forced(decoder, prompt, ref, ref_logits))
        print(f"prompt {i} ({results[-1].prompt_tokens} tokens): {results[-1].describe()}",
              flush=True)
    agreement = float(np.mean([r.agreement for r in results]))
    kls = [r.kl for r in results]
    kl = None if None in kls else float(np.mean(kls))
    print(f"mean over {len(results)} prompts: top-1 agreement {agreement:.4f}, "
          f"mean KL {describe_kl(kl)}")
    failed = min_agreement is not None and agreement < min_agreement
    if failed:
        print(f"FAIL: mean top-1 agreement {agreement:.4f} is below "
              f"--min-agreement {min_agreement}")
    summary = {"agreement": agreement, "kl": kl, "prompts": len(results),
               "positions": sum(r.positions for r in results), **settings,
               "backend": jax.default_backend()}
    print(f"PARITY {json.dumps(summary)}", flush=True)
    return 1 if failed else 0


class ReferenceMismatch(ValueError):
    """A saved reference that was not made for these prompt ids and --max-tokens."""


def save_reference(file: str | Path, model_path: str | Path, prompts: list[list[int]],
                   references: list[list[int]], max_new_tokens: int) -> None:
    entries = [{"prompt": p, "tokens": ref} for p, ref in zip(prompts, references, strict=True)]
    Path(file).write_text(json.dumps({"model": Path(model_path).name,
                                      "max_tokens": max_new_tokens, "prompts": entries}) + "\n")


def read_reference(file: str | Path, model_path: str | Path, prompts: list[list[int]],
                   max_new_tokens: int) -> list[list[int]]:
    """The saved reference tokens per prompt, once the file proves it was made for these
    prompt ids and this --max-tokens."""
    try:
        saved = json.loads(Path(file).read_text())
        model, n, entries = saved["model"], saved["max_tokens"], saved["prompts"]
        pairs = [(list(e["prompt"]), list(e["tokens"])) for e in entries]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReferenceMismatch(f"{file}: not a saved reference ({e!r})") from e
    if n != max_new_tokens:
        raise ReferenceMismatch(f"{file}: saved with --max-tokens {n}, not {max_new_tokens}")
    if len(pairs) != len(prompts):
        raise ReferenceMismatch(f"{file}: {len(pairs)} prompts, the prompt file has "
                                f"{len(prompts)}")
    for i, ((saved_prompt, tokens), prompt) in enumerate(zip(pairs, prompts, strict=True)):
        if saved_prompt != prompt:
            raise ReferenceMismatch(f"{file}: prompt {i} has other token ids than we encode "
                                    f"(another prompt file or tokenizer?)")
        if len(tokens) != n or not all(isinstance(t, int) for t in tokens):
            raise ReferenceMismatch(f"{file}: prompt {i} needs {n} reference token ids, "
                                    f"has {tokens}")
    if model != Path(model_path).name:
        print(f"warning: {file} was saved for {model}, we load {Path(model_path).name}",
              file=sys.stderr)
    return [tokens for _, tokens in pairs]


def read_prompts(file: str | Path) -> list[str | list[dict]]:
    prompts = []
    for n, line in enumerate(Path(file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip()[:1] in ('"', "{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{n}: invalid JSON ({e})") from e
            prompts.append(value["messages"] if isinstance(value, dict) else value)
        else:
            prompts.append(line)
    return prompts


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict]) -> list[int]:
    if isinstance(prompt, list):
        text = ChatTemplate.for_tokenizer(tokenizer).render(prompt, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.parity",
                                     description="Parity against transformers.")
    parser.add_argument("--model", required=True,
                        help="GGUF file or HF model directory, or a known model's name "
                             "(smollm2-135m, gemma3-270m: fetched if missing)")
    parser.add_argument("--prompts", required=True, help="prompt file, one per line")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quantization", choices=["auto", *SCHEMES],
                        help="load our weights quantized (as the server's flag) and measure "
                             "top-1 agreement and KL against the float32 reference instead of "
                             "greedy parity, which runs on float weights")
    parser.add_argument("--kv-cache-dtype",
                        choices=["float32", "bfloat16", "float16", "int8", "fp8"],
                        help="hold our KV pages in this dtype and measure top-1 agreement and "
                             "KL against the float32 reference instead of greedy parity")
    # No default: naming a dtype, float32 included, asks for the measurement, as
    # --kv-cache-dtype does; without it our float32 model is held to greedy parity.
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="load our weights in this dtype (float32 when not given) and "
                             "measure top-1 agreement and KL instead of greedy parity")
    parser.add_argument("--min-agreement", type=float,
                        help="with --quantization, --kv-cache-dtype or --dtype: fail if the "
                             "mean top-1 agreement is below")
    parser.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto",
                        help="how the layers loop, as the server's --layer-loop (auto: the "
                             "Pallas product of a layer read in place on one GPU)")
    parser.add_argument("--cpu-matmul-dtype", choices=WIDE_DTYPES, default="float32",
                        help="the dtype products of more than 8 rows (the prompt's) multiply "
                             "in on a CPU, as the server's flag")
    parser.add_argument("--cpu-activation-dtype", choices=tuple(X_BITS), default="float32",
                        help="the precision x keeps in the CPU kernel's 4-bit products, as the "
                             "server's flag (int8: measured by agreement, as --quantization)")
    parser.add_argument("--save-reference", metavar="FILE",
                        help="write the reference's greedy token ids per prompt to FILE "
                             "(JSON) and stop, without loading our model")
    parser.add_argument("--reference", metavar="FILE",
                        help="take the reference's tokens from a --save-reference FILE "
                             "instead of running transformers (agreement only, no KL)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    measured = (any(v is not None for v in (args.quantization, args.kv_cache_dtype, args.dtype))
                or args.cpu_activation_dtype != "float32")
    if args.min_agreement is not None and not measured:
        parser.error("--min-agreement needs --quantization, --kv-cache-dtype, --dtype or "
                     "--cpu-activation-dtype int8")
    if args.reference and args.save_reference:
        parser.error("--reference and --save-reference exclude each other")
    if args.reference and not measured:
        parser.error("greedy parity needs the reference's logits to judge near-ties and "
                     "--reference holds only its tokens: measure top-1 agreement with "
                     "--dtype, --quantization or --kv-cache-dtype")

    args.model = model_arg(args.model)
    tokenizer = Tokenizer.for_model(args.model)
    prompts = [encode_prompt(tokenizer, p) for p in read_prompts(args.prompts)]
    if args.save_reference:
        ref_model = load_reference(args.model)
        refs = [reference_greedy(ref_model, p, args.max_tokens)[0] for p in prompts]
        save_reference(args.save_reference, args.model, prompts, refs, args.max_tokens)
        print(f"wrote {args.save_reference}: {len(prompts)} prompts, "
              f"{args.max_tokens} reference tokens each")
        return 0
    if args.reference:
        try:
            saved = read_reference(args.reference, args.model, prompts, args.max_tokens)
        except ReferenceMismatch as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    longest = max(len(p) for p in prompts) + args.max_tokens
    dtype = args.dtype or "float32"
    model = load_model(args.model, dtype=dtype, quantization=args.quantization or "none")
    set_run_options(model, layer_loop=args.layer_loop, cpu_matmul_dtype=args.cpu_matmul_dtype,
                    cpu_activation_dtype=args.cpu_activation_dtype)
    decoder = GreedyDecoder(model, max_len=longest, kv_dtype=args.kv_cache_dtype)
    if args.reference:
        references = [(tokens, None) for tokens in saved]
    else:
        ref_model = load_reference(args.model)
        if not measured:
            return check_greedy(decoder, ref_model, prompts, args.max_tokens)
        references = (reference_greedy(ref_model, p, args.max_tokens) for p in prompts)
    settings = {"dtype": dtype, "quantization": args.quantization,
                "kv_cache_dtype": args.kv_cache_dtype, "layer_loop": args.layer_loop,
                "pallas_products": model.stacked_kernel,
                "cpu_activation_dtype": args.cpu_activation_dtype,
                "wide_dtype": None if model.wide_dtype is None else jax.numpy.dtype(
                    model.wide_dtype).name}
    return check_agreement(decoder, prompts, references, args.min_agreement, settings)


if __name__ == "__main__":
    sys.exit(main())
