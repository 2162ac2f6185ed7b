"""RequestStream: one request's outputs (deltas) on their way from the engine thread to the
event loop, with a bounded backlog: a consumer that lags gets merged deltas, one that stops
reading gets its request aborted (StreamBacklogError)."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

from engine.config import STREAM_MAX_ITEMS
from engine.outputs import RequestOutput
from engine.scheduler import RequestRejected

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


class StreamBacklogError(RequestRejected):
    """A request's undelivered outputs passed their bound: its consumer stopped reading, and
    the request was aborted."""


def _deliver(batch: list[tuple[RequestStream, object]]) -> None:  # on the event loop
    for stream, item in batch:
        stream._push(item)


class RequestStream:
    """One request's outputs (deltas) as an async iterator. The engine thread feeds it
    through `call_soon_threadsafe`; `close()` before the last output aborts the request.

    What waits here is bounded: past STREAM_MAX_ITEMS waiting outputs, new ones merge into
    the last (deltas: the merge holds the new tokens once), and past the engine's
    `stream_backlog_limit` token ids and logprobs handed over and not yet read the request
    is aborted and the consumer, if it ever reads again, gets a StreamBacklogError. The
    engine thread counts what it hands over and aborts there, so the bound holds however
    late the event loop takes its deliveries."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompt_token_ids: list[int]):
        self.engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._loop = asyncio.get_running_loop()
        self._items: collections.deque = collections.deque()  # outputs and errors, in order
        self._ready = asyncio.Event()
        self.sent = 0  # token ids and top logprobs handed over (written by the engine thread)
        self.taken = 0  # ... and read by the consumer (written on the event loop)
        self.overflowed = False  # past the backlog limit: aborted (set by the engine thread)
        self.finished = False
        self._closed = False
        self._aborted = False

    def put(self, item) -> None:  # engine thread
        RequestStream.put_all([(self, item)])

    @property
    def backlog(self) -> int:
        """Token ids and top logprobs handed over and not read yet."""
        return self.sent - self.taken

    @staticmethod
    def put_all(items: list[tuple[RequestStream, object]]) -> None:  # engine thread
        """Hand a step's outputs to their streams with one wake-up per event loop (each
        `call_soon_threadsafe` writes to the loop's self-pipe: 64 of them a step at 64
        streams, where one does); a stream past its backlog limit has its request aborted
        here, on the engine thread."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            if isinstance(item, RequestOutput) and not stream.overflowed:
                stream.sent += item.size
                if (not item.finished
                        and stream.backlog > stream.engine.stream_backlog_limit):
                    stream.overflowed = True  # the event loop turns it into the error
                    stream.engine.abort(stream.request_id)
            by_loop.setdefault(stream._loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_deliver, batch)

    def _push(self, item) -> None:  # event loop
        if self._closed or self._aborted:
            return  # (what was in flight when it ended)
        if isinstance(item, RequestOutput):
            if self.overflowed:
                item = self._abort_backlogged()
            elif len(self._items) >= STREAM_MAX_ITEMS and isinstance(self._items[-1],
                                                                     RequestOutput):
                self._items[-1].add(item)
                item = None
        if item is not None:
            self._items.append(item)
        self._ready.set()

    def _abort_backlogged(self) -> StreamBacklogError:
        """Drop what waits (the memory goes now, not when the consumer comes back; the engine
        thread has aborted the request); the error is what the consumer reads next."""
        limit = self.engine.stream_backlog_limit
        logger.warning("Request %s aborted: %d token ids and logprobs wait on its stream "
                       "(limit %d); its client is not reading", self.request_id, self.backlog,
                       limit)
        error = StreamBacklogError(f"request {self.request_id} was aborted: its output was not "
                                   f"read fast enough ({self.backlog} token ids and logprobs "
                                   f"waiting, limit {limit})")
        self._items.clear()
        self._aborted = True
        return error

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.taken += item.size
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._items.clear()
            if self.finished:
                self.engine._streams.pop(self.request_id, None)
            elif not self._aborted:
                self.engine.abort(self.request_id)
