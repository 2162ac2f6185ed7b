"""AsyncEngine: one engine thread per model, an asyncio front end, and recovery.

The event loop never touches the device: requests and aborts go to the engine
thread through a thread-safe inbox; outputs (deltas) come back to each request's
stream with `call_soon_threadsafe`. A stream's backlog is bounded (engine/request_stream.py):
a consumer that lags gets merged deltas, one that stops reading gets its request aborted. If the
engine thread dies, in-flight requests end with an `EngineDeadError`, and the engine
is rebuilt from its saved config (the thread and its recovery: engine/engine_thread.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable

from engine import cluster
from engine.config import STREAM_BACKLOG_LIMIT, EngineConfig
from engine.engine_thread import EngineDeadError, EngineThread
from engine.grammar import COMPILE_TIMEOUT_S, GrammarError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.scheduler import RequestRejected
from models.chat_template import ChatTemplate


class EngineOverloaded(RuntimeError):
    """The waiting queue is full."""


class UnknownModel(KeyError):
    pass


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0               # fraction of usable KV blocks held by sequences
    num_free_blocks: int = 0
    num_usable_blocks: int = 0
    num_touched_blocks: int = 0         # blocks written at least once (BlockManager)
    kv_cache_bytes: int = 0             # the KV pool's bytes on the device
    weight_bytes: int = 0               # the weights' bytes on the device
    prefix_cache_queries: int = 0       # full blocks looked up in the prefix cache
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0                # requests aborted unfinished (clients that left)
    compilations_after_warmup: int = 0
    spec_decode_num_drafts: int = 0     # sequence-steps that brought drafts (engine/speculative)
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    num_restarts: int = 0
    alive: bool = True
    warm: bool = False


def _counters(engine: LLMEngine) -> dict[str, int]:
    """An engine's counters (EngineStats' fields that add up over rebuilt engines)."""
    bm, sched, spec = engine.block_manager, engine.scheduler, engine.scheduler.drafting.stats
    return {"prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions, "num_aborted": engine.num_aborted,
            "compilations_after_warmup": engine.runner.compilations_after_warmup,
            "spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens}


class AsyncEngine(EngineThread):
    task = "generate"  # (an EmbeddingEngine's is "embed")

    def __init__(self, config: EngineConfig,
                 factory: Callable[[EngineConfig], LLMEngine] | None = None,
                 stream_backlog_limit: int = STREAM_BACKLOG_LIMIT,
                 sampling_defaults: dict | None = None):
        # The model's sampling values for what a request leaves unset (the server's;
        # models.generation_config, engine.launch).
        self.sampling_defaults = dict(sampling_defaults or {})
        self.stream_backlog_limit = stream_backlog_limit  # per stream (RequestStream)
        super().__init__(config, factory or (lambda cfg: LLMEngine(cfg)))
        self.tokenizer = self.engine.tokenizer
        # Requests in the inbox (its aborts and wakes are not waiting requests), counted
        # when put and when the engine thread takes them.
        self._queued = 0
        self._queued_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._chat_template = None
        self._retired = EngineStats()  # counters of engines that died
        self._start()
        if cluster.leader is not None:
            cluster.leader.on_lost(self._cluster_lost)

    @property
    def engine(self) -> LLMEngine:
        """The device side (rebuilt after a death)."""
        return self._core

    # ---- front end (event loop) -----------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._queued + len(self.engine.scheduler.waiting)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return self.engine.vocab_size

    @property
    def busy(self) -> bool:
        """Whether requests are queued or running (read from other threads: an embedding
        engine beside this one gives way while it is; engine/embedding_engine.py)."""
        return self._queued > 0 or self.engine.has_unfinished()

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None, add_special_tokens: bool = True,
                          cache_salt: str | None = None,
                          session: str | None = None) -> RequestStream:
        """Validate and queue a request; its outputs come from the returned stream. Rejections
        (too long, empty, overloaded, engine down) raise here, before anything is queued."""
        self._check_accepting()
        params = params or SamplingParams()
        self.engine.check_logit_bias(params)
        ids = await self.encode(prompt, add_special_tokens)
        if params.structured_outputs is not None:
            await self.compile_grammar(params.structured_outputs)
        self.engine.scheduler.check_fits(len(ids), params.max_tokens)
        self._check_accepting()  # it may have changed while tokenizing
        request_id = request_id or f"{self.name}-{next(self._ids)}"
        if request_id in self._streams:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, ids)
        self._streams[request_id] = stream
        with self._queued_lock:
            self._queued += 1
        self._inbox.put(("add", request_id, ids, params, cache_salt, session))
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield outputs (deltas) as they come; the last one has `finished` set. Leaving
        the iterator early (a client disconnect) aborts the request."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _check_accepting(self) -> None:
        if cluster.lost() is not None:
            raise EngineDeadError(f"engine {self.name} is down: multi-host cluster lost "
                                  f"({cluster.lost()})")
        if not self.alive:
            raise EngineDeadError(f"engine {self.name} is rebooting")
        if self.num_waiting >= self.config.max_waiting_requests:
            raise EngineOverloaded(f"engine {self.name} has {self.num_waiting} waiting "
                                   f"requests (limit {self.config.max_waiting_requests})")

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a request's grammar off the event loop, within COMPILE_TIMEOUT_S, into the
        engine's cache (the engine thread then takes its copy from there); GrammarError when
        it does not compile, costs too much, or takes too long."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, self.engine.grammars.compile, spec),
                                   COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise GrammarError(f"the structured output took longer than {COMPILE_TIMEOUT_S:g} s "
                               f"to compile") from None

    async def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, tokenized off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.engine.encode, prompt, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs); partial UTF-8 shows as U+FFFD."""
        return [self.tokenizer.decode([i]) for i in ids]

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template; ValueError when its files carry none."""
        if self._chat_template is None:
            self._chat_template = ChatTemplate.for_tokenizer(self.tokenizer)
        return self._chat_template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, /,
                    **extra) -> str:
        """The prompt text for a chat; ValueError names what is wrong with the messages."""
        return self.chat_template.render(messages, add_generation_prompt, **extra)

    def stats(self) -> EngineStats:
        """A snapshot for metrics; counters include engines that died and were rebuilt."""
        engine, done = self.engine, self._retired
        bm, sched = engine.block_manager, engine.scheduler
        counters = {k: getattr(done, k) + v for k, v in _counters(engine).items()}
        return EngineStats(
            num_running=len(sched.running), num_waiting=self.num_waiting,
            kv_usage=bm.usage, num_free_blocks=bm.num_free_blocks,
            num_usable_blocks=bm.num_usable_blocks, num_touched_blocks=bm.num_touched_blocks,
            kv_cache_bytes=engine.runner.kv_bytes(),
            weight_bytes=engine.runner.weight_bytes, **counters,
            num_restarts=self.num_restarts, alive=self.alive and cluster.lost() is None,
            warm=engine.runner.warm)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._inbox.put(("abort", request_id))

    def release_session(self, session: str) -> None:
        """A stored conversation is gone: the blocks it kept become ordinary cached ones."""
        self._inbox.put(("release", session))

    # ---- engine thread --------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stopping:
            block = not self.engine.has_unfinished()
            self._drain(block)
            if self.engine.has_unfinished():
                outs = self.engine.step()
                RequestStream.put_all([(stream, o) for o in outs if (
                    stream := self._streams.get(o.request_id)) is not None])

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

    def _taken(self, cmd) -> None:
        if cmd[0] == "add":
            with self._queued_lock:
                self._queued -= 1

    def _handle(self, cmd) -> None:
        self._taken(cmd)
        if cmd[0] == "add":
            _, request_id, ids, params, cache_salt, session = cmd
            if request_id not in self._streams:  # abandoned before it was queued
                return
            try:
                self.engine.add_request(ids, params, request_id, cache_salt, session)
            except ValueError as e:  # rejected: the caller sees the reason
                self._send(request_id, e)
        elif cmd[0] == "release":
            self.engine.release_session(cmd[1])
        elif cmd[0] == "abort":
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._send(cmd[1], out)

    def _send(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _cluster_lost(self, reason: str) -> None:
        """From the cluster's watcher thread: fail every request now, whatever the engine
        thread is doing (it may be blocked for good in a collective with the dead peer)."""
        self.alive = False
        self._fail_all(EngineDeadError(f"engine {self.name} failed: multi-host cluster lost "
                                       f"({reason})"))

    def _fail_all(self, error: EngineDeadError) -> None:
        for request_id in list(self._streams):
            self._send(request_id, error)

    def _fail_waiting(self, error: EngineDeadError) -> None:
        self._fail_all(error)
        while True:  # requests queued meanwhile fail too
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._taken(cmd)
            if cmd[0] == "add":
                self._send(cmd[1], error)

    def _retire(self, dead: LLMEngine) -> None:
        # The dead engine's counters stay in the stats; its host bookkeeping stays readable
        # until the next one is built.
        self._retired = dataclasses.replace(self._retired, **{
            k: getattr(self._retired, k) + v for k, v in _counters(dead).items()})


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
