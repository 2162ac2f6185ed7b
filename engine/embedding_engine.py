"""EmbeddingEngine: a pooling model's engine thread and the asyncio front end of
/v1/embeddings.

A request brings one or more inputs, each a list of token ids, and each input is a row. The
engine thread takes waiting rows in arrival order into one batch while their tokens fit the
token budget (and the rows `max_num_seqs`), packs them one after another into one token axis
(as a decoder's ragged step packs its sequences: no row is padded to the longest), pads that
to the smallest bucket of the runner's table (`embed_buckets`), runs it, and hands a request
its vectors when its last row is done. A client
that leaves drops its rows that have not run. Like `AsyncEngine`: a bounded waiting queue
(EngineOverloaded), and a runner that fails is rebuilt while its requests end with
EngineDeadError. While a generating model of the same server has work, this engine runs
one input a step and its steps take at most `embedding_share` of the time (it waits after
each), so chat beside embeddings keeps most of its speed where the two share the device.

The runner (engine/embedding_runner.py) is the device side; this module is pure Python and
numpy.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import time
from collections.abc import Callable

import numpy as np

from engine.async_engine import EngineOverloaded, EngineStats
from engine.config import EngineConfig
from engine.engine_thread import EngineDeadError, EngineThread
from engine.scheduler import RequestRejected

# The token buckets: multiples of 16 up to 128, then eight a doubling (a batch pads by at
# most 1/8 of its tokens), up to the token budget (or the model's length, if longer: a long
# input always runs alone).
MIN_TOKENS = 16
STEPS_PER_DOUBLING = 8


def embed_buckets(max_num_seqs: int, max_num_batched_tokens: int,
                  max_model_len: int) -> tuple[tuple[int, int], ...]:
    """The (tokens, rows) buckets warmup compiles and batches pad to: token counts from 16 up
    to the budget, each with room for min(tokens, max_num_seqs) rows."""
    top = max(max_num_batched_tokens, max_model_len)
    sizes, t = [], MIN_TOKENS
    while True:
        sizes.append(min(t, top))
        if t >= top:
            break
        octave = 1 << (t.bit_length() - 1)  # the power of two at or below t
        t += max(MIN_TOKENS, octave // STEPS_PER_DOUBLING)
    return tuple((t, min(t, max_num_seqs)) for t in sizes)


def bucket_for(buckets, rows: int, tokens: int) -> tuple[int, int] | None:
    """The smallest bucket holding `rows` rows of `tokens` tokens in all (None if none)."""
    return next((b for b in buckets if b[0] >= tokens and b[1] >= rows), None)


@dataclasses.dataclass(eq=False)
class _Request:
    inputs: list[list[int]]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    vectors: list = dataclasses.field(default_factory=list)
    left: int = 0
    cancelled: bool = False

    def __post_init__(self):
        self.vectors = [None] * len(self.inputs)
        self.left = len(self.inputs)

    def resolve(self, value) -> None:  # engine thread
        def settle():
            if not self.future.done():
                (self.future.set_exception if isinstance(value, BaseException)
                 else self.future.set_result)(value)
        self.loop.call_soon_threadsafe(settle)


class EmbeddingEngine(EngineThread):
    """One pooling model: `await embed(inputs)` -> float32 [len(inputs), hidden]."""

    task = "embed"

    def __init__(self, config: EngineConfig, factory: Callable | None = None):
        if factory is None:
            from engine.embedding_runner import EmbeddingRunner  # the device side
            factory = EmbeddingRunner
        super().__init__(config, factory)
        self._rows: collections.deque = collections.deque()  # (request, input index), waiting
        self._waiting = 0  # requests queued and not yet finished
        self._running = 0  # rows in the step under way
        # Engines whose work comes first: while one is busy, this one runs at most
        # config.embedding_share of the time (engine.launch sets them: the server's generators).
        self.yield_to: list = []
        self._start()

    @property
    def runner(self):
        """The device side (rebuilt after a death)."""
        return self._core

    # ---- front end (event loop) -----------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def dimensions(self) -> int:
        return self.runner.hidden_size

    @property
    def truncations(self) -> tuple[int, ...]:
        """The vector sizes a request may ask for (`dimensions`): a model trained for
        truncation names them; others none."""
        return self.runner.truncations

    @property
    def normalizes(self) -> bool:
        return self.runner.pooling.normalize

    @property
    def num_waiting(self) -> int:
        return self._waiting

    async def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids as the model's tokenizer adds them (its [CLS]/[SEP]
        included), tokenized off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: [self.runner.encode(t) for t in texts])

    def check_input(self, ids: list[int]) -> None:
        """RequestRejected (a 400) for an input the model cannot take."""
        if not ids:
            raise RequestRejected("an input has no tokens")
        if len(ids) > self.max_model_len:
            raise RequestRejected(
                f"an input of {len(ids)} tokens is longer than this model's maximum context "
                f"length of {self.max_model_len} tokens")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is outside the vocabulary "
                                  f"[0, {self.vocab_size})")

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """The pooled vector of each input (token ids), float32 [len(inputs), dimensions]."""
        for ids in inputs:
            self.check_input(ids)
        if not self.alive:
            raise EngineDeadError(f"engine {self.name} is rebooting")
        if self._waiting >= self.config.max_waiting_requests:
            raise EngineOverloaded(f"engine {self.name} has {self._waiting} waiting requests "
                                   f"(limit {self.config.max_waiting_requests})")
        loop = asyncio.get_running_loop()
        request = _Request([list(ids) for ids in inputs], loop.create_future(), loop)
        self._waiting += 1
        self._inbox.put(request)
        try:
            return await request.future
        finally:
            request.cancelled = True  # done, failed or abandoned: its rows run no more
            self._waiting -= 1

    def stats(self) -> EngineStats:
        runner = self.runner
        return EngineStats(num_running=self._running, num_waiting=self._waiting,
                           weight_bytes=runner.weight_bytes,
                           compilations_after_warmup=runner.compilations_after_warmup,
                           num_restarts=self.num_restarts, alive=self.alive, warm=runner.warm)

    def release_session(self, session: str) -> None:
        """(An embedding engine keeps no conversations.)"""

    # ---- engine thread --------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stopping:
            self._drain(block=not self._rows)
            batch = self._take()
            if batch:
                start = time.perf_counter()
                self._run(batch)
                self._give_way(time.perf_counter() - start)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not self.WAKE:
                    self._rows.extend((item, i) for i in range(len(item.inputs)))
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _take(self) -> list[tuple[_Request, int]]:
        """The waiting rows of the next step, in arrival order, as many as fit the token
        budget and the row cap (one row at least, however long)."""
        batch, used = [], 0
        budget, cap = self.config.max_num_batched_tokens, self.config.max_num_seqs
        if self._giving_way():  # short steps, so a generator's step never waits long
            cap = 1
        while self._rows:
            request, i = self._rows[0]
            if request.cancelled:
                self._rows.popleft()
                continue
            n = len(request.inputs[i])
            if batch and (used + n > budget or len(batch) == cap):
                break
            batch.append(self._rows.popleft())
            used += n
        return batch

    def _run(self, batch: list[tuple[_Request, int]]) -> None:
        ids = [request.inputs[i] for request, i in batch]
        size, rows = bucket_for(self.runner.buckets, len(ids), sum(map(len, ids)))
        tokens = np.zeros(size, np.int32)  # [T]: the rows one after another, then padding
        tokens[:sum(map(len, ids))] = np.concatenate(ids)
        lengths = np.zeros(rows, np.int32)
        lengths[:len(ids)] = [len(row) for row in ids]
        self._running = len(batch)
        try:
            vectors = self.runner.run(tokens, lengths)
        except Exception:
            self._rows.extendleft(reversed(batch))  # failed with the rest (_reboot)
            raise
        finally:
            self._running = 0
        for row, (request, i) in enumerate(batch):
            request.vectors[i] = vectors[row]
            request.left -= 1
            if request.left == 0:
                request.resolve(np.stack(request.vectors))

    def _give_way(self, step_s: float) -> None:
        """After a step of `step_s` seconds, while an engine of `yield_to` has work, wait so
        that this engine's steps take at most `embedding_share` of the time."""
        if not self._giving_way():
            return
        until = time.perf_counter() + step_s * (1 / self.config.embedding_share - 1)
        while not self._stopping and time.perf_counter() < until and self._giving_way():
            time.sleep(0.002)

    def _giving_way(self) -> bool:
        return self.config.embedding_share < 1 and any(e.busy for e in self.yield_to)

    def _fail_waiting(self, error: EngineDeadError) -> None:
        while True:  # what is queued fails too
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not self.WAKE:
                self._rows.append((item, 0))
        for request in {r for r, _ in self._rows}:
            request.resolve(error)
        self._rows.clear()
