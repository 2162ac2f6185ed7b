"""What xlaserve loads from its cache is code, so it must be this user's alone
(ops/cache_trust.py): the executable store (engine/executable_store.py) and the CPU kernels' library
(ops/native) are created private, and a file is refused, with a warning naming the path and
why, when it or a directory on the way to it could be changed by someone else; what was
refused is compiled or built afresh, never loaded."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from engine.config import EngineConfig
from engine.executable_store import ExecutableStore, executable_store_dir
from engine.model_runner import ModelRunner
from ops import cache_trust, native

BUCKET = ("seqs", 1)  # one LM head + sampler: the quickest of the default model
ROOT = Path(__file__).resolve().parents[1]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask022():
    """The common umask, under which the old code made 0755 directories."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def store_dir(tmp_path, monkeypatch, caplog, umask022):
    """A store root that does not exist yet (the store makes it)."""
    caplog.set_level(logging.WARNING, logger="engine.executable_store")
    monkeypatch.setenv("XLASERVE_COMPILE_CACHE", str(tmp_path / "store"))
    return tmp_path / "store"


def _runner(default_gguf) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(default_gguf), dtype="float32", max_model_len=64,
                                    max_num_seqs=2, max_num_batched_tokens=4, block_size=16,
                                    num_blocks=9))


@pytest.fixture(scope="module")
def tiny_executable():
    """A compiled x * 2 + 1 over float32[4]: what the store keeps, without a model."""
    return jax.jit(lambda x: x * 2 + 1).lower(jax.ShapeDtypeStruct((4,), jnp.float32)).compile()


def _store() -> ExecutableStore:
    """The store a runner of this process gets (None when executable_store_dir refuses)."""
    root = executable_store_dir()
    return None if root is None else ExecutableStore(root, "key", jax.devices()[:1])


def _stored(tiny_executable) -> tuple[ExecutableStore, Path]:
    store = _store()
    store.save(BUCKET, tiny_executable)
    assert store.load(BUCKET) is not None
    return store, store.directory / "seqs-1.pkl"


# ---- the executable store --------------------------------------------------------------

def test_the_store_creates_private_directories_and_files(tiny_executable, store_dir):
    store, path = _stored(tiny_executable)
    assert _mode(store_dir) == 0o700
    assert _mode(store.directory) == 0o700
    assert _mode(path) == 0o600
    assert [p.name for p in store.directory.iterdir()] == [path.name]  # no temporary left


def test_a_group_writable_executable_is_compiled_and_replaced(default_gguf, store_dir, caplog):
    """The whole path: a runner refuses the file, compiles, and stores a private file in its
    place (its directory passes), which loads."""
    first = _runner(default_gguf)
    first.compile_bucket(BUCKET)
    path = first.store.directory / "seqs-1.pkl"
    path.chmod(0o620)
    again = _runner(default_gguf)
    again.compile_bucket(BUCKET)
    assert again.num_stored_loads == 0  # compiled, not loaded
    assert f"{path} is writable by group (mode 0620)" in caplog.text
    assert _mode(path) == 0o600
    assert again.store.load(BUCKET) is not None


def test_a_group_writable_store_root_turns_the_store_off(tiny_executable, store_dir, caplog):
    _stored(tiny_executable)
    store_dir.chmod(0o770)
    assert executable_store_dir() is None  # a runner then compiles everything
    assert f"{store_dir} is writable by group (mode 0770)" in caplog.text


def test_a_group_writable_configuration_directory_is_refused(tiny_executable, store_dir,
                                                             caplog):
    store, path = _stored(tiny_executable)
    store.directory.chmod(0o770)
    before = os.stat(path)
    again = _store()
    assert again.load(BUCKET) is None and not again.has(BUCKET)
    assert f"{store.directory} is writable by group (mode 0770)" in caplog.text
    again.save(BUCKET, tiny_executable)  # nothing is written into the refused directory
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [p.name for p in store.directory.iterdir()] == [path.name]


def test_a_store_of_another_user_is_refused(tiny_executable, store_dir, caplog, monkeypatch):
    """Files of another user cannot be made without root: this process pretends to be
    someone else instead."""
    store, _ = _stored(tiny_executable)
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    assert executable_store_dir() is None
    assert store.load(BUCKET) is None
    assert f"{store_dir} is owned by uid {uid}, not by this user ({uid + 1})" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_an_executable_of_another_user_is_refused_and_replaced(tiny_executable, store_dir,
                                                               caplog):
    store, path = _stored(tiny_executable)
    os.chown(path, 12345, -1)
    assert store.load(BUCKET) is None
    assert f"{path} is owned by uid 12345, not by this user (0)" in caplog.text
    store.save(BUCKET, tiny_executable)
    assert os.stat(path).st_uid == 0 and store.load(BUCKET) is not None


# ---- the checks themselves -------------------------------------------------------------

def test_links_and_odd_files_below_the_root_are_refused(tmp_path, umask022):
    root = cache_trust.private_dir(tmp_path / "root", "sub")
    Path(root, "file").write_bytes(b"ok")
    assert cache_trust.open_private(tmp_path / "root", "sub/file").read() == b"ok"
    (root / "link").symlink_to(root / "file")
    (tmp_path / "root" / "dirlink").symlink_to(root)
    os.mkfifo(root / "fifo")  # opened without blocking, then refused
    for relative, reason in [("sub/link", "is a symbolic link"),
                             ("dirlink/file", "is a symbolic link"),
                             ("sub/fifo", "is not a regular file")]:
        with pytest.raises(cache_trust.UntrustedPath, match=reason):
            cache_trust.open_private(tmp_path / "root", relative)
    with pytest.raises(FileNotFoundError):
        cache_trust.open_private(tmp_path / "root", "sub/absent")
    # The root itself may be a link the user made: what it points at is checked.
    (tmp_path / "alias").symlink_to(tmp_path / "root")
    assert cache_trust.open_private(tmp_path / "alias", "sub/file").read() == b"ok"
    assert [_mode(tmp_path / "root"), _mode(root)] == [0o700, 0o700]


def test_others_writable_directory_is_refused_and_not_written_into(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root").chmod(0o1777)  # like /tmp
    with pytest.raises(cache_trust.UntrustedPath, match=r"writable by group and others"):
        cache_trust.private_dir(tmp_path / "root", "sub")
    assert not (tmp_path / "root" / "sub").exists()


# ---- the CPU kernels' library ----------------------------------------------------------

needs_kernels = pytest.mark.skipif(not native.available("qmatmul"),
                                   reason=f"CPU kernel unavailable: {native.reason('qmatmul')}")

# A stand-in for the C++ compiler: it "builds" by copying the library this process loaded
# (so a fresh process registers real kernels) and counts its builds in $FAKE_CXX_LOG.
_FAKE_CXX = """#!/bin/sh
[ "$1" = --version ] && { echo fake-cxx 1; exit 0; }
while [ $# -gt 1 ]; do
  if [ "$1" = -o ]; then echo build >> "$FAKE_CXX_LOG"; cp "$FAKE_CXX_LIBRARY" "$2"; exit 0; fi
  shift
done
exit 1
"""

_LOAD = """
import os, sys
os.umask(0o022)
if sys.argv[1:] == ["someone-else"]:
    os.getuid = lambda uid=os.getuid() + 1: uid
from ops import native
print("available:", native.available("qmatmul"))
print("reason:", native.reason("qmatmul"))
"""


@pytest.fixture(scope="module")
def fake_cxx(tmp_path_factory):
    library = native._cache_dir() / native.library_name("qmatmul")
    if not library.is_file():
        pytest.skip(f"this process's kernel library is not in the cache ({library})")
    cxx = tmp_path_factory.mktemp("cxx") / "c++"
    cxx.write_text(_FAKE_CXX)
    cxx.chmod(0o700)
    return {"CXX": str(cxx), "FAKE_CXX_LIBRARY": str(library)}


def _load_kernels(fake_cxx, cache: Path, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    """A fresh process loads the kernels from the user cache `cache` (its log on stderr);
    and how many times it built them."""
    log = cache.parent / f"{cache.name}-builds.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, **fake_cxx, "FAKE_CXX_LOG": str(log), "XDG_CACHE_HOME": str(cache),
           "XLASERVE_CPU_KERNELS": "auto"}
    done = subprocess.run([sys.executable, "-c", _LOAD, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done, len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def kernel_cache(fake_cxx, tmp_path):
    """A user cache in which a fresh process built the kernels, and their library."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    done, builds = _load_kernels(fake_cxx, cache)
    assert "available: True" in done.stdout and builds == 1
    [library] = (cache / "xlaserve" / "kernels").glob("xlaserve-*.so")
    return cache, library


@needs_kernels
def test_the_kernel_library_is_built_private(kernel_cache, fake_cxx):
    cache, library = kernel_cache
    assert _mode(cache / "xlaserve") == 0o700
    assert _mode(library.parent) == 0o700
    assert _mode(library) == 0o600
    assert [p.name for p in library.parent.iterdir()] == [library.name]
    done, builds = _load_kernels(fake_cxx, cache)  # ... and loaded as it is the next time
    assert "available: True" in done.stdout and builds == 0


@needs_kernels
def test_a_group_writable_kernel_library_is_rebuilt(kernel_cache, fake_cxx):
    cache, library = kernel_cache
    library.chmod(0o620)
    before = os.stat(library)
    done, builds = _load_kernels(fake_cxx, cache)
    assert "available: True" in done.stdout and builds == 1
    assert f"{library} is writable by group (mode 0620); rebuilding it" in done.stderr
    after = os.stat(library)
    assert after.st_ino != before.st_ino and _mode(library) == 0o600  # replaced, private


@needs_kernels
def test_a_group_writable_kernels_directory_is_not_used(kernel_cache, fake_cxx):
    cache, library = kernel_cache
    library.parent.chmod(0o770)
    before = os.stat(library)
    done, builds = _load_kernels(fake_cxx, cache)
    assert "available: True" in done.stdout and builds == 1  # in a private temporary directory
    assert f"{library.parent} is writable by group (mode 0770)" in done.stderr
    after = os.stat(library)  # neither loaded nor touched
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [p.name for p in library.parent.iterdir()] == [library.name]


@needs_kernels
def test_a_kernel_cache_of_another_user_leaves_the_kernels_off(kernel_cache, fake_cxx):
    """This process pretends to be someone else: the cache is refused, and so is a private
    temporary directory (its own, as far as the check can tell): the kernels are off, with
    the reason, and nothing was built."""
    cache, library = kernel_cache
    done, builds = _load_kernels(fake_cxx, cache, "someone-else")
    assert "available: False" in done.stdout and builds == 0
    assert f"{library.parent} is owned by uid {os.getuid()}" in done.stderr
    assert "is owned by uid" in done.stdout.split("reason:")[1]
