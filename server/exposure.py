"""How the HTTP server is exposed: its API key and where it came from, the Host names it
answers, what the startup log warns about, the open-file limit a connection cap needs, and
uvicorn run with those settings (`serve`). server/cli.py's flags choose them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import uvicorn

from server.connections import with_deadlines
from server.middleware import LOOPBACK_HOSTS, is_loopback

logger = logging.getLogger("server")

API_KEY_ENV = "XLASERVE_API_KEY"


def read_secret(path: str, flag: str) -> str:
    """A secret kept in a file, so that the process list does not show it: the file's text
    without surrounding whitespace."""
    secret = Path(path).read_text().strip()
    if not secret:
        raise ValueError(f"{flag} {path} is empty")
    return secret


def api_key(args) -> tuple[str | None, str]:
    """The API key, and where it came from (named in the startup log)."""
    if args.api_key_file:
        return read_secret(args.api_key_file, "--api-key-file"), "--api-key-file"
    if args.api_key:
        return args.api_key, "--api-key"
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV], API_KEY_ENV
    return None, "none"


def allowed_hosts(args) -> list[str]:
    """--allowed-hosts, or its default: the loopback names when bound to loopback (only a
    page served from this machine can then name it), any name otherwise, so that a
    deployment reached by names the server cannot know keeps working."""
    if args.allowed_hosts:
        return [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    if is_loopback(args.host):
        return list(dict.fromkeys([*LOOPBACK_HOSTS, args.host]))
    return ["*"]


def http_warnings(args, key_source: str) -> list[str]:
    """What the startup log must warn about in how the HTTP server is exposed."""
    warnings = []
    if key_source == "--api-key":
        warnings.append("the API key is on the command line, where the process list shows it "
                        f"to every user of this machine: use --api-key-file or {API_KEY_ENV}")
    if not is_loopback(args.host):
        if key_source == "none":
            warnings.append(f"bound to {args.host}, beyond this machine, with no API key: "
                            f"anyone who can reach port {args.port} can use the models; set "
                            f"--api-key-file or {API_KEY_ENV}")
        if args.allowed_hosts is None:
            warnings.append(f"bound to {args.host} with any Host name accepted: set "
                            "--allowed-hosts to the names clients use (a web page can reach a "
                            "server it may not name by DNS rebinding)")
    return warnings


def allow_open_files(connections: int) -> None:
    """Raise the soft open-file limit (within the hard one) to fit `connections`: a cap
    above it means nothing, accept() fails first."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256  # weights, the listening socket, the engines' own files
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < want:
        logger.warning("--limit-concurrency %d is above what the open-file limit (%d) leaves "
                       "room for: raise `ulimit -n`", connections, new)


def serve(app, args, key_source: str) -> None:
    """Run uvicorn on `app` with the connection settings the flags chose, said in the log."""
    limit = args.limit_concurrency or None
    if limit:
        allow_open_files(limit)
    logger.info("HTTP: Host names allowed: %s; API key: %s; keep-alive %d s; headers within "
                "%g s, bodies within %g s; streams cut after %g s without a completed write; "
                "%s", ", ".join(allowed_hosts(args)),
                "none" if key_source == "none" else f"from {key_source}",
                args.timeout_keep_alive, args.header_read_timeout, args.body_read_timeout,
                args.stream_stall_timeout,
                f"503 from {limit} connections" if limit else "no connection cap")
    for warning in http_warnings(args, key_source):
        logger.warning(warning)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5, timeout_keep_alive=args.timeout_keep_alive,
                limit_concurrency=limit,
                http=with_deadlines(args.header_read_timeout, args.body_read_timeout))
