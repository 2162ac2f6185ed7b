"""The README's commands, as a new user copies them: the quick ones run (against a live
server where they need one), and every flag the long-running ones give exists."""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SERVER_KEY

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DEFAULT_URL = "http://127.0.0.1:8000"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def _commands() -> list[str]:
    """Every shell command of the README's bash blocks, continuation lines joined and the
    trailing comments dropped."""
    text = "\n".join(_blocks("bash")).replace("\\\n", " ")
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in text.splitlines()
            if line.strip()]


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    first = _commands()[:2]
    assert first == ["pip install -e . && python -m server",
                     "pip install -e '.[dev]' && python -m pytest"]
    assert len(README.splitlines()) <= 200
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith(
        "pip install -e '.[dev]' && python -m pytest")  # CI runs exactly that


def _program(words: list[str]) -> list[str]:
    """The argv prefix that names the program (and subcommand) of a README command."""
    if words[:2] == ["python", "-m"]:
        n = 4 if words[2:4] == ["engine.bench", "serve"] else 3
        return [sys.executable, *words[1:n]]
    if words[0] == "python" and words[1].endswith(".py"):
        return [sys.executable, words[1]]
    return []


@functools.cache
def _help(program: tuple[str, ...]) -> str:
    """The program's --help (several commands share one: each start imports jax, seconds)."""
    return subprocess.run([*program, "--help"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.parametrize("command", [c for c in _commands() if "python" in c
                                     and "pip install" not in c])
def test_every_flag_of_a_command_exists(command):
    words = shlex.split(command)
    program = _program(words)
    assert program, f"not a python command: {command}"
    help_text = _help(tuple(program))
    for flag in (w.split("=")[0] for w in words[len(program):] if w.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", help_text), f"{flag} of {command!r}"
    if "--model" in words and program[-1] == "server":
        from models.known_models import KNOWN_MODELS

        value = words[words.index("--model") + 1]
        assert value in KNOWN_MODELS or "=" in value, value


def _against(url: str, text: str) -> str:
    return text.replace(DEFAULT_URL, url)


def test_the_curl_request_gets_a_chat_reply(live_server):
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    [curl] = [c for c in _commands() if c.startswith("curl ")]
    proc = subprocess.run(_against(live_server, curl) + f" -sS -H 'Authorization: Bearer "
                          f"{SERVER_KEY}'", shell=True, capture_output=True, text=True,
                          check=True)
    assert '"choices"' in proc.stdout and '"assistant"' in proc.stdout, proc.stdout


def test_the_python_examples_run(live_server, tmp_path):
    client, offline = _blocks("python")
    client = _against(live_server, client).replace('"unused-without---api-key"',
                                                   repr(SERVER_KEY))
    for code in (client, offline):
        script = tmp_path / "example.py"
        script.write_text(code)
        proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip(), code  # each example prints a reply
