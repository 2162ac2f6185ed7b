"""Parity against Hugging Face transformers (PyTorch, CPU, float32) on the same weights.

    python -m models.parity --model PATH --prompts FILE --max-tokens N
    python -m models.parity ... --quantization int4 [--min-agreement 0.93]

Prompt file: one prompt per line. A line may be plain text, a JSON string (for
newlines and escapes), or a JSON object {"messages": [...]} rendered with the
model's chat template. Both sides get the same token ids.

Float32 (the default): we decode greedily, and at the first position where the
tokens differ we look at the reference's logits there: a divergence is accepted
only when our token is the reference's runner-up and its top-2 gap is below 1e-3
(a near-tie that float rounding can flip). Exit code 0 only if every prompt passes.

--quantization int8|int4|w8a8: quantized weights cannot match token for token, so we
measure how close they come. The reference decodes greedily; our quantized model
is teacher-forced on the prompt plus the reference's tokens (one forward pass, all
logits) and we report, per prompt and on average, the top-1 agreement (fraction of
positions where our argmax is the reference's token) and the mean KL(ref || ours)
of the next-token distributions. Exit code 1 if the mean agreement is below
--min-agreement.

Needs the `dev` extra (torch, transformers, accelerate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from models.chat_template import ChatTemplate
from models.generate import GreedyDecoder
from models.known_models import model_arg
from models.loader import load_model, model_format
from models.tokenizer import Tokenizer
from ops.quantization import SCHEMES

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


def agreement_and_kl(ours: np.ndarray, ref_tokens: list[int], ref_logits: np.ndarray):
    """Over N positions ([N, V] logits each side): (fraction where our argmax is the
    reference's token, mean KL(ref || ours) in nats)."""
    if ours.shape != ref_logits.shape or len(ref_tokens) != len(ours):
        raise ValueError(f"logits {ours.shape} vs reference {ref_logits.shape} "
                         f"with {len(ref_tokens)} tokens")
    agreement = float(np.mean(np.argmax(ours, axis=-1) == np.asarray(ref_tokens)))
    log_p, log_q = log_softmax(ref_logits), log_softmax(ours)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)  # [N]
    return agreement, float(kl.mean())


@dataclasses.dataclass
class AgreementResult:
    prompt_tokens: int
    positions: int
    agreement: float  # top-1 agreement with the reference's greedy tokens
    kl: float         # mean KL(ref || ours), nats

    def describe(self) -> str:
        return (f"top-1 agreement {self.agreement:.4f} "
                f"({round(self.agreement * self.positions)}/{self.positions}), "
                f"mean KL {self.kl:.3e}")


def compare_teacher_forced(decoder: GreedyDecoder, ref_model, prompt: list[int],
                           max_new_tokens: int) -> AgreementResult:
    ref, ref_logits = reference_greedy(ref_model, prompt, max_new_tokens)
    # Row len(prompt) - 1 + i predicts the reference's i-th new token.
    ours = decoder.prompt_logits(prompt + ref[:-1])[len(prompt) - 1:]  # [N, V]
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


def check_agreement(decoder: GreedyDecoder, ref_model, prompts: list[list[int]],
                    max_new_tokens: int, min_agreement: float | None) -> int:
    results = []
    for i, prompt in enumerate(prompts):
        results.append(compare_teacher_forced(decoder, ref_model, prompt, max_new_tokens))
        print(f"prompt {i} ({results[-1].prompt_tokens} tokens): {results[-1].describe()}",
              flush=True)
    agreement = float(np.mean([r.agreement for r in results]))
    kl = float(np.mean([r.kl for r in results]))
    print(f"mean over {len(results)} prompts: top-1 agreement {agreement:.4f}, "
          f"mean KL {kl:.3e}")
    if min_agreement is not None and agreement < min_agreement:
        print(f"FAIL: mean top-1 agreement {agreement:.4f} is below "
              f"--min-agreement {min_agreement}")
        return 1
    return 0


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


def main(argv=None) -> int:
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
    parser.add_argument("--min-agreement", type=float,
                        help="with --quantization or --kv-cache-dtype: fail if the mean "
                             "top-1 agreement is below")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    measured = args.quantization is not None or args.kv_cache_dtype is not None
    if args.min_agreement is not None and not measured:
        parser.error("--min-agreement needs --quantization or --kv-cache-dtype")

    args.model = model_arg(args.model)
    tokenizer = Tokenizer.for_model(args.model)
    prompts = [encode_prompt(tokenizer, p) for p in read_prompts(args.prompts)]
    longest = max(len(p) for p in prompts) + args.max_tokens
    model = load_model(args.model, dtype="float32", quantization=args.quantization or "none")
    decoder = GreedyDecoder(model, max_len=longest, kv_dtype=args.kv_cache_dtype)
    ref_model = load_reference(args.model)
    if not measured:
        return check_greedy(decoder, ref_model, prompts, args.max_tokens)
    return check_agreement(decoder, ref_model, prompts, args.max_tokens, args.min_agreement)


if __name__ == "__main__":
    sys.exit(main())
