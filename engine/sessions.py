"""The session store: responses kept between requests (the Responses API's `store`), so a
later request can continue one by its id (`previous_response_id`).

A stored response is the response object a client can fetch again and the conversation it
ended (chat messages, its own reply included): a continuation re-renders that conversation
with the new input, and the engine's prefix cache finds the earlier turns' blocks, so only
the new tokens are computed. Records are kept as serialized JSON, so the bytes the store
holds are counted exactly; it is bounded by count, by bytes and by idle time, and gives up
its least recently used records first.

While a response is stored, the engine keeps its conversation's KV blocks apart from other
cached blocks (`BlockManager.keep`, under the response's id); `on_drop` tells the engines
when it leaves, and they release them.

Pure Python; the server owns one per process, so an engine reboot keeps it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: dict        # the response object, as GET /v1/responses/{id} returns it
    messages: list[dict]  # the conversation it ended, as chat messages


class SessionStore:
    """Stored responses by id, least recently used first out. `ttl_s`: seconds a record may go
    unread before it is dropped (None: kept until count or bytes push it out)."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_BYTES, ttl_s: float | None = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[str], None] | None = None):
        if max_responses < 0 or max_bytes < 0 or (ttl_s is not None and ttl_s <= 0):
            raise ValueError("the session store's limits must be >= 0 (a TTL > 0)")
        self.max_responses, self.max_bytes, self.ttl_s = max_responses, max_bytes, ttl_s
        self._clock = clock
        # Called with a response's id when it leaves (evicted, expired, deleted, or refused):
        # the engines release the KV blocks its session kept.
        self.on_drop = on_drop
        self._records: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # id -> (record,
        self.nbytes = 0                                                      # last use)
        self.evicted = 0  # records dropped for the limits (not deleted by a client)

    def __len__(self) -> int:
        return len(self._records)

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep a response; False when it alone is larger than the store."""
        record = json.dumps({"response": stored.response, "messages": stored.messages},
                            ensure_ascii=False, separators=(",", ":")).encode("utf-8",
                                                                             "surrogatepass")
        self.delete(response_id)
        if len(record) > self.max_bytes or self.max_responses == 0:
            self._dropped(response_id)
            return False
        self._records[response_id] = (record, self._clock())
        self.nbytes += len(record)
        self._expire()
        while len(self._records) > self.max_responses or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._records)))
            self.evicted += 1
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        self._expire()
        entry = self._records.get(response_id)
        if entry is None:
            return None
        self._records[response_id] = (entry[0], self._clock())
        self._records.move_to_end(response_id)
        data = json.loads(entry[0])
        return StoredResponse(data["response"], data["messages"])

    def delete(self, response_id: str) -> bool:
        if response_id not in self._records:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        record, _ = self._records.pop(response_id)
        self.nbytes -= len(record)
        self._dropped(response_id)

    def _dropped(self, response_id: str) -> None:
        if self.on_drop is not None:
            self.on_drop(response_id)

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        limit = self._clock() - self.ttl_s
        while self._records:
            oldest = next(iter(self._records))
            if self._records[oldest][1] > limit:
                break
            self._drop(oldest)
            self.evicted += 1
