"""Greedy parity against Hugging Face transformers (PyTorch, CPU) on the same weights.

    python -m models.parity --model PATH --prompts FILE --max-tokens N

Prompt file: one prompt per line. A line may be plain text, a JSON string (for
newlines and escapes), or a JSON object {"messages": [...]} rendered with the
model's chat template. Both sides get the same token ids; we decode greedily,
and at the first position where the tokens differ we look at the reference's
logits there: a divergence is accepted only when our token is the reference's
runner-up and its top-2 gap is below 1e-3 (a near-tie that float rounding can
flip). Exit code 0 only if every prompt passes.

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
from models.loader import load_model, model_format
from models.tokenizer import Tokenizer

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
                                     description="Greedy parity against transformers.")
    parser.add_argument("--model", required=True, help="GGUF file or HF model directory")
    parser.add_argument("--prompts", required=True, help="prompt file, one per line")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    tokenizer = Tokenizer.from_path(args.model)
    prompts = [encode_prompt(tokenizer, p) for p in read_prompts(args.prompts)]
    longest = max(len(p) for p in prompts) + args.max_tokens
    decoder = GreedyDecoder(load_model(args.model, dtype="float32"), max_len=longest)
    ref_model = load_reference(args.model)
    failed = 0
    for i, prompt in enumerate(prompts):
        result = compare(decoder, ref_model, prompt, args.max_tokens)
        failed += not result.passed
        print(f"prompt {i} ({result.prompt_tokens} tokens): {result.describe()}", flush=True)
    print(f"{len(prompts) - failed}/{len(prompts)} prompts pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
