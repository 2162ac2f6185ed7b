"""SimulatedRunner: the device of `python -m engine.bench --simulate-device-ms`, which
takes a fixed time per step and computes nothing, so that the bench measures the host path
alone."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from engine.config import EngineConfig
from engine.model_runner import StepResult


class SimulatedRunner:
    """A device that takes `step_ms` per step and computes nothing: each row's next token is a
    fixed function of its last one (never a special token). Steps run in order on a thread
    of their own that sleeps, so the host thread keeps its core and the GIL, as while an
    accelerator runs; `submit` returns at once."""

    def __init__(self, config: EngineConfig, step_ms: float, vocab_size: int,
                 special: frozenset[int]):
        self.config, self.step_s = config, step_ms / 1e3
        self.compilations_after_warmup, self.warm = 0, False
        self.num_steps, self.busy_s = 0, 0.0
        ok = np.array([t for t in range(min(vocab_size, 32000)) if t not in special], np.int32)
        self._next = np.full(max(vocab_size, 32000), ok[0], np.int32)
        self._next[ok] = np.roll(ok, -7)  # a permutation of the ordinary ids
        self._last = np.zeros(config.max_num_seqs + 1, np.int32)  # per slot, as on a device
        self._device = concurrent.futures.ThreadPoolExecutor(1, "simulated-device")

    def warmup(self) -> float:
        self.warm = True
        return 0.0

    def release(self) -> None:
        self.warm = False

    def submit(self, batch):
        return self._device.submit(self._step, batch)

    def run(self, batch) -> StepResult:
        return self.submit(batch).result()

    def _step(self, batch) -> StepResult:
        start = time.perf_counter()
        n = batch.num_rows
        ids = self._next[batch.host_tokens(self._last)[batch.logits_indices[:n]]]
        self._last[batch.sampling["slots"][:n]] = ids
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - start)))
        self.num_steps += 1
        self.busy_s += time.perf_counter() - start
        return StepResult(ids, np.zeros(n, np.float32), np.zeros((n, 20), np.int32),
                          np.zeros((n, 20), np.float32))
