"""Repository rules: the import layering of docs/architecture.md (import-linter contracts)
and a clean `ruff check`."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not installed (pip install -e '.[dev]')")
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_is_clean():
    exe = shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff not installed (pip install -e '.[dev]')")
    proc = subprocess.run([exe, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
