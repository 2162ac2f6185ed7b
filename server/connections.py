"""uvicorn's HTTP/1.1 protocol (h11) with the read deadlines uvicorn lacks.

uvicorn closes a connection idle after a response (`timeout_keep_alive`) and caps
connections (`limit_concurrency`), but waits without end for a request's headers, from
the connection's first byte or a client that never sends one, and for the rest of a
body the app answered without reading (a 401, a 413 on its declared length). A few
such connections would fill the cap. Here each of those waits has a deadline, after
which the connection is closed:

- headers: `header_timeout` seconds from the connection's start or the last response;
- an unread body after the response: `body_timeout` seconds from the response.

The body of a request the app is reading has its deadline in the app
(`server.middleware.RequestLimits`), which answers 408.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def with_deadlines(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,),
                {"timeouts": {"headers": header_timeout, "body": body_timeout}})


class DeadlineH11Protocol(H11Protocol):
    timeouts: dict[str, float]  # what we wait for -> seconds (set by with_deadlines)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.deadline: asyncio.TimerHandle | None = None
        self.waiting_for: str | None = None
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Keep the deadline of what the connection waits for now; a new wait starts its
        own clock, bytes that do not finish the current one do not."""
        state = self.conn.their_state
        if state is h11.IDLE:
            waiting_for = "headers"
        elif state is h11.SEND_BODY and (self.cycle is None or self.cycle.response_complete):
            waiting_for = "body"  # answered already: nobody will read the rest
        else:  # a body the app reads (its own deadline), or nothing to wait for
            waiting_for = None
        if waiting_for != self.waiting_for:
            self._set_deadline(waiting_for)

    def _set_deadline(self, waiting_for: str | None) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.waiting_for = waiting_for
        self.deadline = (None if waiting_for is None else
                         self.loop.call_later(self.timeouts[waiting_for], self._expire))

    def _expire(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        logger.debug("closing a connection: its %s did not arrive within %g s",
                     self.waiting_for, self.timeouts[self.waiting_for])
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()
