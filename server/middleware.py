"""Pure ASGI middleware: request limits and API-key auth, applied before any route runs.

Both look only at the ASGI scope as the server parsed it: `scope["path"]`, never a
URL rebuilt from the Host header, so a forged Host cannot make a request look like
it is for an open route.
"""

from __future__ import annotations

import hmac

from server.errors import APIError


class RequestLimits:
    """At most `max_headers` headers and `max_body_bytes` of body (413 past it, whether the
    client declared a Content-Length or streams a chunked body)."""

    def __init__(self, app, max_body_bytes: int, max_headers: int):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_headers = max_headers

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        if len(headers) > self.max_headers:
            error = APIError(431, f"too many headers: {len(headers)} (limit {self.max_headers})")
            return await error.response()(scope, receive, send)
        declared = next((v for k, v in headers if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(int(declared)).response()(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large(received)  # handled by the app's APIError handler
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"request body of {size} bytes or more is over the limit of "
                             f"{self.max_body_bytes} bytes")


class APIKeyAuth:
    """`Authorization: Bearer <key>` on every route except the open ones (constant-time check)."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str] = frozenset({"/health"})):
        self.app = app
        self.expected = b"Bearer " + api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer "
                                      "<key>')", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)
