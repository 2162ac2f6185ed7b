"""Seeded sampling gives the same tokens and logprobs whatever shares its steps.

The default model with `--batch-invariant` and the server's other defaults (float16 KV
pages, our CPU kernels where they build, 64 sequences and 512 tokens a step): 16 seeded
prompts (temperature 0.8) run alone,
then two at a time, seven at a time, and among 33 and 64 concurrent sequences whose long
prompts are prefilled in chunks that share the seeded decodes' steps. Every run must give
each prompt the same token ids and the same logprobs, bit for bit.
"""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

WORDS = ("the sea river mountain light keeper engine token page block cache quick brown fox "
         "jumps over lazy dog numbers 1 2 3 42 code def return while café").split()
NEW_TOKENS = 16


def _prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(default_gguf):
    eng = LLMEngine(EngineConfig(model=str(default_gguf), batch_invariant=True))
    eng.runner.warmup()
    return eng


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=NEW_TOKENS, logprobs=1,
                          ignore_eos=True)


def _result(out) -> tuple[list[int], list[float]]:
    seq = out.outputs[0]
    return seq.token_ids, [lp.logprob for lp in seq.logprobs]


def test_seeded_requests_sample_alike_alone_and_in_any_batch(engine):
    rng = random.Random(0)
    prompts = _prompts(rng, 16, 3, 150)
    others = _prompts(rng, 63, 30, 150)  # together prefilled over several steps
    alone = [_result(engine.generate([p], _seeded(i))[0]) for i, p in enumerate(prompts)]
    assert len({tuple(a[0]) for a in alone}) == 16  # the prompts and seeds do differ

    def run(seeded: list[int], concurrency: int) -> None:
        fill = concurrency - len(seeded)
        batch = [(prompts[i], _seeded(i), i) for i in seeded] + [
            (others[j], SamplingParams(temperature=0.7, seed=j,
                                       max_tokens=rng.randint(1, 2 * NEW_TOKENS)), None)
            for j in rng.sample(range(len(others)), fill)]
        rng.shuffle(batch)
        outs = engine.generate([b[0] for b in batch], [b[1] for b in batch])
        for (_, _, i), out in zip(batch, outs, strict=True):
            if i is not None:
                assert _result(out) == alone[i], f"prompt {i} at {concurrency} sequences"

    for start in range(0, 16, 2):
        run([start, start + 1], 2)
    for group in ([0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [14, 15]):
        run(group, 7)
    run(list(range(16)), 33)
    run(list(range(16)), 64)
    assert engine.runner.compilations_after_warmup == 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
