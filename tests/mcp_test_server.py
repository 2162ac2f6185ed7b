"""A small MCP server over stdio, written with the SDK, for tests/test_mcp.py: a tool that
echoes, one that fails with a message, one that crashes, one that never answers (and says
in a file that it started, then that it was cancelled), and one that exits the process.

    python tests/mcp_test_server.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("xlaserve-test")


@server.tool(description="Returns its text.")
def echo(text: str) -> str:
    return text


@server.tool(description="Fails, saying why.")
def fail(reason: str = "the disk is full") -> str:
    raise ToolError(f"could not do it: {reason}")


@server.tool(description="Raises an unexpected exception.")
def crash() -> str:
    raise RuntimeError("a secret the client must not see")


@server.tool(description="Never answers; writes 'started' to `marker`, then 'cancelled' when "
                         "it is cancelled.")
async def hang(marker: str = "") -> str:
    # Only a file in the temporary directory: a model calling this picks the path itself.
    path = Path(marker) if marker else None
    if path is not None and not (path.is_absolute() and path.resolve().is_relative_to(
            Path(tempfile.gettempdir()).resolve())):
        path = None
    if path is not None:
        path.write_text("started")
    try:
        await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        if path is not None:
            path.write_text("cancelled")
        raise
    return "unreachable"


@server.tool(description="Exits the server process.")
def die() -> str:
    os._exit(3)


if __name__ == "__main__":
    server.run("stdio")
