"""`python -m server` as a subprocess for the HTTP tests: started, polled until /health says
ready, stopped."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port(consecutive: int = 1) -> int:
    """A port on 127.0.0.1 that is free now, with the next `consecutive - 1` free as well."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for extra in range(1, consecutive):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + extra))
            return port
        except OSError:
            continue


def server_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "server", *args]


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "XLASERVE_NO_PROGRESS": "1", **(env or {})}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n"
                               f"{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready in time:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def running_server(args: list[str], log: Path, env: dict | None = None):
    """Yield the base URL of a ready `python -m server --port P *args`."""
    port = free_port()
    proc = spawn(server_command("--port", str(port), *args), log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        yield url
    finally:
        stop(proc)


@contextlib.contextmanager
def running_server_process(args: list[str], log: Path, env: dict | None = None):
    """`running_server`, yielding (base URL, the process): for what the process itself shows
    (its command line)."""
    port = free_port()
    proc = spawn(server_command("--port", str(port), *args), log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        yield url, proc
    finally:
        stop(proc)
