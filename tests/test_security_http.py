"""The HTTP layer's defences against a live `python -m server` on 127.0.0.1: what a web page
in the user's browser can send (a `text/plain` body, a rebound DNS name as Host), clients that
send slowly or hold connections, and what the server shows of itself (the weights' path, the
API key in its command line).

One server for the file: the default model under a key read from a file, with short read
timeouts and a cap of a few connections (each test closes its connections, so the next one
starts under the cap)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from conftest import SERVER_KEY, SERVER_LIMITS
from servers import running_server_process
from test_server_openai import metrics

from server import cli, exposure
from server.middleware import HostCheck

NAME = "served-name"
AUTH = {"Authorization": f"Bearer {SERVER_KEY}"}
HEADER_TIMEOUT, BODY_TIMEOUT, CAP = 4, 2, 4
BOUND = 60  # seconds: only turns a server that never acts into a failure


@pytest.fixture(scope="module")
def server(default_gguf, tmp_path_factory):
    """(base URL, process, the model file's path) of the file's server."""
    tmp = tmp_path_factory.mktemp("security")
    (tmp / "key").write_text(SERVER_KEY + "\n")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SERVER_LIMITS.items()]
    args = ["--model", str(default_gguf), "--served-model-name", NAME,
            "--api-key-file", str(tmp / "key"), "--header-read-timeout", str(HEADER_TIMEOUT),
            "--body-read-timeout", str(BODY_TIMEOUT), "--limit-concurrency", str(CAP), *flags]
    with running_server_process(args, tmp / "server.log") as (url, proc):
        yield url, proc, default_gguf


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=BOUND)


def cut_off(sock: socket.socket, trickle: bytes) -> tuple[bytes, float]:
    """Send `trickle` a byte every 50 ms (from the start again when it runs out) until the
    server answers, then read until it closes the connection; (what it answered, seconds
    it took), or a failure past BOUND."""
    sock.settimeout(0.05)
    start, answer, i = time.monotonic(), b"", 0
    while time.monotonic() - start < BOUND:
        try:
            if not answer:
                sock.sendall(trickle[i % len(trickle):][:1])
                i += 1
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if not chunk:  # closed
            break
        answer += chunk
    else:
        pytest.fail(f"the server still reads after {BOUND} s; it answered {answer!r}")
    return answer, time.monotonic() - start


# ---- what a web page can send -----------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_declared_json_is_415_and_generates_nothing(server, content_type):
    """A page may POST these cross-origin without a CORS preflight; a JSON body can't be."""
    url, _, _ = server
    body = f'{{"model": "{NAME}", "prompt": "Hi", "max_tokens": 2}}'.encode()
    before = metrics(url).get("prompt_tokens_total", 0)
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        headers = AUTH if content_type is None else {**AUTH, "Content-Type": content_type}
        r = httpx.post(url + route, content=body, headers=headers)
        assert_error(r, 415, code="unsupported_media_type")
    assert metrics(url).get("prompt_tokens_total", 0) == before
    # The same body declared as JSON (parameters and case as clients send them) is served,
    # and counts.
    r = httpx.post(url + "/v1/completions", content=body,
                   headers={**AUTH, "Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text
    assert metrics(url)["prompt_tokens_total"] > before


def test_a_foreign_host_is_421_and_loopback_names_pass(server):
    """DNS rebinding: the attacker's name, pointed at 127.0.0.1, arrives as Host."""
    url, _, _ = server
    port = url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                 f"localhost.evil.example:{port}", "[::2]"):
        r = httpx.get(f"{url}/v1/models", headers={**AUTH, "Host": host})
        assert_error(r, 421, code="host_not_allowed")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                       headers={**AUTH, "Host": host})
        assert_error(r, 421, code="host_not_allowed")
    for host in ("localhost", f"localhost:{port}", f"LocalHost:{port}", f"127.0.0.1:{port}",
                 f"[::1]:{port}", "[::1]"):
        r = httpx.get(f"{url}/v1/models", headers={**AUTH, "Host": host})
        assert r.status_code == 200, (host, r.text)
    # A load balancer probes /health by its own name for the server.
    assert httpx.get(f"{url}/health", headers={"Host": "lb.internal"}).status_code == 200


# ---- slow clients and the connection cap ------------------------------------------------------


def test_a_slowly_sent_body_is_cut_off_with_408(server):
    url, _, _ = server
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            f"{SERVER_KEY}\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    with connect(url) as sock:
        sock.sendall(head.encode() + b'{"prompt": "')
        answer, seconds = cut_off(sock, b"x")
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"did not arrive within 2 s" in answer and b"connection: close" in answer.lower()
    assert seconds >= BODY_TIMEOUT - 0.5


def test_slow_or_missing_headers_are_cut_off(server):
    url, _, _ = server
    with connect(url) as idle, connect(url) as slow:
        slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        answer, seconds = cut_off(slow, b"X-Slow: a\r\n")
        assert answer == b"" and seconds >= HEADER_TIMEOUT - 1
        idle.settimeout(BOUND)
        assert idle.recv(1) == b""  # closed, never having sent a byte


def test_an_unread_body_after_an_early_answer_is_cut_off(server):
    """A 401 is answered without reading the body; the client may not trickle the rest for
    ever on that connection."""
    url, _, _ = server
    head = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            "application/json\r\nContent-Length: 100000\r\n\r\n")
    with connect(url) as sock:
        sock.sendall(head.encode())
        answer, _ = cut_off(sock, b" ")
    assert answer.startswith(b"HTTP/1.1 401 "), answer


def test_past_the_connection_cap_requests_get_503(server):
    url, _, _ = server
    holders = [connect(url) for _ in range(CAP - 1)]  # with the next one: CAP connections
    try:
        deadline = time.monotonic() + HEADER_TIMEOUT - 1  # before the holders are closed
        while time.monotonic() < deadline:
            r = httpx.get(f"{url}/v1/models", headers=AUTH)
            if r.status_code == 503:
                break
        assert r.status_code == 503, r.text
    finally:
        for s in holders:
            s.close()
    end = time.monotonic() + BOUND
    while httpx.get(f"{url}/v1/models", headers=AUTH).status_code != 200:
        assert time.monotonic() < end, "still 503 with the holders gone"
        time.sleep(0.05)


# ---- what the server shows of itself ----------------------------------------------------------


def test_models_show_the_served_name_not_the_weights_path(server):
    url, _, path = server
    for r in (httpx.get(f"{url}/v1/models", headers=AUTH),
              httpx.get(f"{url}/v1/models/{NAME}", headers=AUTH)):
        assert r.status_code == 200, r.text
        assert str(path.parent) not in r.text and path.name not in r.text
    cards = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
    assert [(c["id"], c["root"]) for c in cards] == [(NAME, NAME)]


def test_the_api_key_comes_from_its_file_and_not_the_command_line(server):
    url, proc, _ = server
    assert_error(httpx.get(f"{url}/v1/models"), 401, code="invalid_api_key")
    assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer x"}), 401)
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert b"--api-key-file" in argv and not any(SERVER_KEY.encode() in a for a in argv)


# ---- the defaults the command line chooses (no server) ----------------------------------------


def test_allowed_host_names_and_patterns():
    check = HostCheck(None, ["api.example.com:8000", "*.example.org", "::1"])
    assert check.allows("API.Example.com") and check.allows("api.example.com:443")
    assert check.allows("a.b.example.org:80") and check.allows("[::1]:8000")
    for host in ("example.org", "evilexample.org", "api.example.com.evil", "", "[::1",
                 "api.example.com@evil"):
        assert not check.allows(host), host


def test_hosts_and_warnings_follow_the_bind_address(tmp_path, monkeypatch):
    monkeypatch.delenv(exposure.API_KEY_ENV, raising=False)
    def settings(*argv):
        args = cli.parser().parse_args(list(argv))
        hosts = exposure.allowed_hosts(args)
        return hosts, exposure.http_warnings(args, exposure.api_key(args)[1])

    key = tmp_path / "key"
    key.write_text("k\n")
    assert settings() == (["localhost", "127.0.0.1", "::1"], [])
    assert settings("--host", "127.0.0.2")[0] == ["localhost", "127.0.0.1", "::1", "127.0.0.2"]
    hosts, warnings = settings("--host", "0.0.0.0")
    assert hosts == ["*"] and len(warnings) == 2
    assert "no API key" in warnings[0] and "--allowed-hosts" in warnings[1]
    assert settings("--host", "0.0.0.0", "--api-key-file", str(key),
                    "--allowed-hosts", "api.example.com, *.example.org") == (
        ["api.example.com", "*.example.org"], [])
    hosts, warnings = settings("--api-key", "k")
    assert len(warnings) == 1 and "process list" in warnings[0]
    assert exposure.api_key(cli.parser().parse_args(["--api-key-file", str(key)])) == (
        "k", "--api-key-file")
    with pytest.raises(SystemExit):  # one or the other
        cli.parser().parse_args(["--api-key", "k", "--api-key-file", str(key)])
