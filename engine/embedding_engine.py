"""EmbeddingEngine: a pooling model's engine thread and the asyncio front end of
/v1/embeddings.

A request brings one or more inputs, each a list of token ids, and each input is a row. The
engine thread takes waiting rows in arrival order into one batch while they fit one bucket of
the runner's table (`embed_buckets`: rows x padded length within the token budget), pads them
to that bucket, runs it, and hands a request its vectors when its last row is done. A client
that leaves drops its rows that have not run. Like `AsyncEngine`: a bounded waiting queue
(EngineOverloaded), and a runner that fails is rebuilt while its requests end with
EngineDeadError.

The runner (engine/embedding_runner.py) is the device side; this module is pure Python and
numpy.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from engine.async_engine import EngineDeadError, EngineOverloaded, EngineStats
from engine.config import EngineConfig, _pow2_upto
from engine.scheduler import RequestRejected

logger = logging.getLogger(__name__)

MIN_LENGTH_BUCKET = 16  # shorter inputs pad to 16 tokens: fewer executables, little padding


def embed_buckets(max_num_seqs: int, max_num_batched_tokens: int,
                  max_model_len: int) -> tuple[tuple[int, int], ...]:
    """The (rows, length) buckets warmup compiles and batches pad to: lengths by powers of two
    up to `max_model_len`, and for each, rows by powers of two while rows x length stays
    within `max_num_batched_tokens` (one row at every length, so a long input always runs)."""
    out = []
    for length in _pow2_upto(min(MIN_LENGTH_BUCKET, max_model_len), max_model_len):
        most = max(1, min(max_num_seqs, max_num_batched_tokens // length))
        out += [(rows, length) for rows in _pow2_upto(1, most)]
    return tuple(out)


def bucket_for(buckets, rows: int, length: int) -> tuple[int, int] | None:
    """The smallest bucket holding `rows` rows of `length` tokens (None if none does)."""
    fits = [b for b in buckets if b[0] >= rows and b[1] >= length]
    return min(fits, key=lambda b: (b[0] * b[1], b[1])) if fits else None


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


class EmbeddingEngine:
    """One pooling model: `await embed(inputs)` -> float32 [len(inputs), hidden]."""

    task = "embed"

    def __init__(self, config: EngineConfig, factory: Callable | None = None):
        self.config = config
        self.name = config.name or config.model
        if factory is None:
            from engine.embedding_runner import EmbeddingRunner  # the device side
            factory = EmbeddingRunner
        self._factory = factory
        self.runner = self._build()
        self.num_restarts = 0
        self.alive = True
        self._inbox: queue.Queue = queue.Queue()
        self._rows: collections.deque = collections.deque()  # (request, input index), waiting
        self._waiting = 0  # requests queued and not yet finished
        self._running = 0  # rows in the step under way
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}",
                                        daemon=True)
        self._thread.start()

    def _build(self):
        runner = self._factory(self.config)
        runner.warmup()
        return runner

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

    async def encode(self, text: str) -> list[int]:
        """A text's token ids as the model's tokenizer adds them (its [CLS]/[SEP] included),
        tokenized off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.runner.encode, text)

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

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout=30)

    # ---- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._serve()
            except Exception as e:  # the runner died: fail its requests, rebuild it
                self._reboot(e)

    def _serve(self) -> None:
        while not self._stopping:
            self._drain(block=not self._rows)
            batch = self._take()
            if batch:
                self._run(batch)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._rows.extend((item, i) for i in range(len(item.inputs)))
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _take(self) -> list[tuple[_Request, int]]:
        """The waiting rows of the next step, in arrival order, as many as one bucket holds."""
        batch, longest = [], 0
        while self._rows:
            request, i = self._rows[0]
            if request.cancelled:
                self._rows.popleft()
                continue
            length = max(longest, len(request.inputs[i]))
            if batch and bucket_for(self.runner.buckets, len(batch) + 1, length) is None:
                break
            batch.append(self._rows.popleft())
            longest = length
        return batch

    def _run(self, batch: list[tuple[_Request, int]]) -> None:
        rows, length = bucket_for(self.runner.buckets, len(batch),
                                  max(len(r.inputs[i]) for r, i in batch))
        tokens = np.zeros((rows, length), np.int32)
        lengths = np.zeros(rows, np.int32)
        for row, (request, i) in enumerate(batch):
            ids = request.inputs[i]
            tokens[row, :len(ids)] = ids
            lengths[row] = len(ids)
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

    def _reboot(self, error: Exception) -> None:
        self.alive = False
        logger.error("Engine %s is dead, rebooting", self.name, exc_info=error)
        failed = EngineDeadError(f"engine {self.name} failed: {type(error).__name__}: {error}")
        while True:  # what is queued fails too: nothing waits on a dead engine
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._rows.append((item, 0))
        for request in {r for r, _ in self._rows}:
            request.resolve(failed)
        self._rows.clear()
        old = self.runner
        old.release()
        while not self._stopping:
            try:
                self.runner = self._build()
                break
            except Exception:
                logger.exception("Rebuilding engine %s failed; retrying in 1s", self.name)
                time.sleep(1.0)
        self.num_restarts += 1
        self.alive = True
        logger.info("Successfully rebooted engine %s", self.name)
