"""The MCP config file of `--mcp-config FILE` (server/mcp_tools.py runs its servers): the
`{"mcpServers": {...}}` file Claude Desktop, VS Code and most MCP clients read, each entry a
stdio server (`command`, `args`, `env`, `cwd`) or a streamable HTTP one (`url`, `headers`),
checked whole at start so a mistake is one clear error, not a server that fails later:

    {"mcpServers": {
        "time": {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"]},
        "search": {"url": "https://example.com/mcp", "headers": {"Authorization": "..."}}}}
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

# OpenAI's rule for a function's name; a server's name must fit it too, as a prefix.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
SERVER_PREFIX_SEP = "__"
_STDIO_KEYS = {"command", "args", "env", "cwd", "type"}
_HTTP_KEYS = {"url", "headers", "type"}
_TYPES = {"stdio": "stdio", "http": "http", "streamable-http": "http", "streamableHttp": "http"}


@dataclasses.dataclass(frozen=True)
class StdioServer:
    """An MCP server run as a subprocess, speaking JSON-RPC on its stdin and stdout."""

    name: str
    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None  # over the SDK's safe defaults (PATH, HOME, ...)
    cwd: str | None = None


@dataclasses.dataclass(frozen=True)
class HttpServer:
    """An MCP server reached over streamable HTTP."""

    name: str
    url: str
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


McpServer = StdioServer | HttpServer


@dataclasses.dataclass(frozen=True)
class McpConfig:
    servers: tuple[McpServer, ...]


def load_mcp_config(path) -> McpConfig:
    """The servers of an `{"mcpServers": {...}}` file; ValueError says what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the MCP config {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the MCP config {path} is not JSON: {e}") from None
    return parse_mcp_config(data, str(path))


def parse_mcp_config(data: Any, source: str = "the MCP config") -> McpConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected an object with \"mcpServers\", got "
                         f"{type(data).__name__}")
    unknown = set(data) - {"mcpServers"}
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(map(repr, sorted(unknown)))}; "
                         f"expected only \"mcpServers\"")
    servers = data.get("mcpServers")
    if not isinstance(servers, dict):
        raise ValueError(f"{source}: \"mcpServers\" must be an object of servers by name")
    return McpConfig(tuple(_server(name, entry, source) for name, entry in servers.items()))


def _server(name: str, entry: Any, source: str) -> McpServer:
    where = f"{source}: server {name!r}"
    if not TOOL_NAME.match(name) or SERVER_PREFIX_SEP in name:
        raise ValueError(f"{where}: a server's name is 1-64 letters, digits, '_', '.' or '-' "
                         f"(without {SERVER_PREFIX_SEP!r}): it may prefix its tools' names")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
    kind = entry.get("type")
    if kind is not None and kind not in _TYPES:
        raise ValueError(f"{where}: unsupported \"type\" {kind!r} (supported: stdio, http; "
                         f"the old SSE transport is not)")
    if "command" in entry and "url" in entry:
        raise ValueError(f"{where}: give \"command\" (stdio) or \"url\" (streamable HTTP), "
                         f"not both")
    if "command" not in entry and "url" not in entry:
        raise ValueError(f"{where}: needs \"command\" (a stdio server) or \"url\" (a "
                         f"streamable HTTP server)")
    is_http = "url" in entry
    if kind is not None and _TYPES[kind] != ("http" if is_http else "stdio"):
        raise ValueError(f"{where}: \"type\" {kind!r} does not fit "
                         f"{'a url' if is_http else 'a command'}")
    unknown = set(entry) - (_HTTP_KEYS if is_http else _STDIO_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, sorted(unknown)))} "
                         f"for a {'streamable HTTP' if is_http else 'stdio'} server")
    if is_http:
        url = entry["url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: \"url\" must be an http:// or https:// URL")
        return HttpServer(name, url, _strings(entry.get("headers", {}), "headers", where))
    command = entry["command"]
    if not isinstance(command, str) or not command:
        raise ValueError(f"{where}: \"command\" must be a non-empty string")
    args = entry.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"{where}: \"args\" must be a list of strings")
    env = _strings(entry["env"], "env", where) if "env" in entry else None
    cwd = entry.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError(f"{where}: \"cwd\" must be a string")
    return StdioServer(name, command, tuple(args), env, cwd)


def _strings(value: Any, key: str, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{where}: \"{key}\" must be an object of strings")
    return dict(value)
