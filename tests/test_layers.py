"""Repository rules: the import layering of docs/architecture.md (import-linter contracts)
and a clean `ruff check`."""

import shutil
import subprocess
import tomllib
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


# The engine modules that import jax themselves (docs/architecture.md names them too).
ENGINE_JAX_MODULES = {"model_runner", "step_table", "embedding_runner", "device",
                      "executable_store", "distributed", "bench.offline", "bench.embed",
                      "bench.ceilings", "bench.attention", "bench.quantization", "profiling"}


def test_every_engine_module_is_named_by_the_jax_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    [contract] = [c for c in contracts if c["name"].startswith("engine/: only ")]
    kept_off = {m.removeprefix("engine.") for m in contract["source_modules"]}
    engine = ROOT / "engine"
    modules = {".".join(p.relative_to(engine).with_suffix("").parts)
               for p in engine.rglob("*.py") if p.stem not in ("__init__", "__main__")}
    assert "bench.serve" in modules  # subpackages are walked
    assert not kept_off & ENGINE_JAX_MODULES
    assert kept_off | ENGINE_JAX_MODULES == modules, "a new engine module: name it in one list"
    assert all(name in contract["name"] for name in ENGINE_JAX_MODULES)


def test_the_long_modules_started_first_exist():
    from conftest import LONG_MODULES

    missing = [name for name in LONG_MODULES if not (ROOT / "tests" / name).exists()]
    assert not missing, "renamed or removed: update tests/conftest.py's LONG_MODULES"
