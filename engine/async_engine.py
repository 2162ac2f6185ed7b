"""AsyncEngine: one engine thread per model, an asyncio front end, and recovery.

The event loop never touches the device: requests and aborts go to the engine
thread through a thread-safe inbox; outputs come back to each request's asyncio
queue with `call_soon_threadsafe`. If the engine thread dies, in-flight requests
end with an `EngineDeadError`, and the engine is rebuilt from its saved config.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine failed while serving this request, or is rebooting."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full."""


class UnknownModel(KeyError):
    pass


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, config: EngineConfig,
                 factory: Callable[[EngineConfig], LLMEngine] | None = None):
        self.config = config
        self.name = config.name or config.model
        self._factory = factory or (lambda cfg: LLMEngine(cfg))
        self.engine = self._build()
        self.tokenizer = self.engine.tokenizer
        self.num_restarts = 0
        self.alive = True
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}",
                                        daemon=True)
        self._thread.start()

    def _build(self) -> LLMEngine:
        engine = self._factory(self.config)
        engine.runner.warmup()
        return engine

    # ---- front end (event loop) -----------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._inbox.qsize() + len(self.engine.scheduler.waiting)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield outputs as they come; the last one has `finished` set. Leaving the
        iterator early (a client disconnect) aborts the request."""
        if not self.alive:
            raise EngineDeadError(f"engine {self.name} is rebooting")
        if self.num_waiting >= self.config.max_waiting_requests:
            raise EngineOverloaded(f"engine {self.name} has {self.num_waiting} waiting "
                                   f"requests (limit {self.config.max_waiting_requests})")
        params = params or SamplingParams()
        loop = asyncio.get_running_loop()
        # Tokenize off the event loop; rejects (too long, empty) raise here, before queueing.
        ids = await loop.run_in_executor(None, self.engine.encode, prompt)
        self.engine.scheduler.check_fits(len(ids), params.max_tokens)
        request_id = request_id or f"{self.name}-{next(self._ids)}"
        stream = _Stream(loop, asyncio.Queue())
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, ids, params))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(("wake",))
        self._thread.join(timeout=30)

    # ---- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._serve()
            except Exception as e:  # the engine died: fail its requests, rebuild it
                self._reboot(e)

    def _serve(self) -> None:
        while not self._stopping:
            block = not self.engine.has_unfinished()
            self._drain(block)
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    self._send(out.request_id, out)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            _, request_id, ids, params = cmd
            if request_id not in self._streams:  # abandoned before it was queued
                return
            try:
                self.engine.add_request(ids, params, request_id)
            except ValueError as e:  # rejected: the caller sees the reason
                self._send(request_id, e)
        elif cmd[0] == "abort":
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._send(cmd[1], out)

    def _send(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _reboot(self, error: Exception) -> None:
        self.alive = False
        logger.error("Engine %s is dead, rebooting", self.name, exc_info=error)
        failed = EngineDeadError(f"engine {self.name} failed: {type(error).__name__}: {error}")
        for request_id in list(self._streams):
            self._send(request_id, failed)
        while True:  # requests queued meanwhile fail too: nothing waits on a dead engine
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._send(cmd[1], failed)
        while not self._stopping:
            try:
                self.engine = self._build()
                break
            except Exception:
                logger.exception("Rebuilding engine %s failed; retrying in 1s", self.name)
                time.sleep(1.0)
        self.num_restarts += 1
        self.alive = True
        logger.info("Successfully rebooted engine %s", self.name)


class Engines:
    """Several models at once, each with its own engine thread, addressed by name."""

    def __init__(self, engines: dict[str, AsyncEngine]):
        self._engines = dict(engines)

    def __getitem__(self, name: str) -> AsyncEngine:
        try:
            return self._engines[name]
        except KeyError:
            raise UnknownModel(f"the model {name!r} does not exist; available: "
                               f"{', '.join(self._engines)}") from None

    def names(self) -> list[str]:
        return list(self._engines)

    def shutdown(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()
