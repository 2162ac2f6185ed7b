"""Pure ASGI middleware: the Host check, request limits and API-key auth, applied before
any route runs.

All look only at the ASGI scope as the server parsed it: `scope["path"]`, never a
URL rebuilt from the Host header, so a forged Host cannot make a request look like
it is for an open route.
"""

from __future__ import annotations

import hmac
import ipaddress

import anyio

from server.errors import APIError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Routes any Host (and no key) may reach: a load balancer probes /health by its own name
# for the server, and the answer is only "ready" or "not ready".
OPEN_PATHS = frozenset({"/health"})


def is_loopback(address: str) -> bool:
    """Whether a bind address (`--host`) is reachable from this machine only."""
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        return False


def host_name(host: str) -> str:
    """The name in a Host header or an --allowed-hosts entry, lower case, without its port
    (`[::1]:8000` -> `::1`, `Example.com:80` -> `example.com`)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, bracket, port = host[1:].partition("]")
        return name if bracket and (not port or port.startswith(":")) else host
    name, colon, port = host.rpartition(":")
    return name if colon and ":" not in name else host


class HostCheck:
    """Only requests whose Host header names this server (421 otherwise): a page on
    another site whose DNS name the attacker has pointed at this machine's address (DNS
    rebinding) reaches the port as the browser's own origin, with its own name as Host.

    `allowed_hosts` holds names (the port is ignored) and `*.example.com` patterns for
    every subdomain."""

    def __init__(self, app, allowed_hosts: list[str], open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.names = {host_name(h) for h in allowed_hosts if not h.startswith("*.")}
        self.suffixes = tuple(h[1:].lower() for h in allowed_hosts if h.startswith("*."))
        self.open_paths = open_paths

    def allows(self, host: str) -> bool:
        name = host_name(host)
        return name in self.names or (bool(name) and name.endswith(self.suffixes))

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            host = next((v for k, v in scope["headers"] if k == b"host"), b"")
            if not self.allows(host.decode("latin-1")):
                error = APIError(421, "this server does not answer to the Host header given; "
                                      "start it with --allowed-hosts to add a name",
                                 code="host_not_allowed")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class RequestLimits:
    """At most `max_headers` headers and `max_body_bytes` of body (413 past it, whether the
    client declared a Content-Length or streams a chunked body), and the whole body within
    `body_read_timeout` seconds of the headers (408 and the connection closed past it, so a
    client trickling its body cannot hold a connection and a task for ever; uvicorn waits
    for a body as long as bytes keep coming)."""

    def __init__(self, app, max_body_bytes: int, max_headers: int, body_read_timeout: float):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_headers = max_headers
        self.body_read_timeout = body_read_timeout

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
        received, complete = 0, False
        deadline = anyio.current_time() + self.body_read_timeout

        async def limited_receive():
            nonlocal received, complete
            if complete:  # what is left to hear is the client leaving: no deadline for that
                return await receive()
            with anyio.move_on_after(deadline - anyio.current_time()):
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.max_body_bytes:
                        raise self._too_large(received)  # the app's APIError handler answers
                complete = message["type"] != "http.request" or not message.get("more_body")
                return message
            raise APIError(408, f"the request body did not arrive within "
                                f"{self.body_read_timeout:g} s of its headers",
                           headers={"Connection": "close"})

        await self.app(scope, limited_receive, send)

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"request body of {size} bytes or more is over the limit of "
                             f"{self.max_body_bytes} bytes")


class APIKeyAuth:
    """`Authorization: Bearer <key>` on every route except the open ones (constant-time check)."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
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
