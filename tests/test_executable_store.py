"""Compiled step executables are stored on disk and loaded back, without tracing, by a runner
of the same fingerprint; a different configuration or an unreadable file compiles afresh."""

from __future__ import annotations

import numpy as np
import pytest

from engine.batch import empty_batch
from engine.config import EngineConfig
from engine.model_runner import ModelRunner


def _config(model, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model), **{
        **dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=4,
               block_size=16, num_blocks=9), **overrides})


def _step(runner: ModelRunner) -> np.ndarray:
    """A two-sequence decode from a prompt token each: the sampled ids (greedy)."""
    batch = empty_batch(runner.config, (2, 2))
    batch.num_rows = 2
    batch.tokens[:2] = [17, 923]
    batch.positions[:2] = 0
    batch.token_seq[:2] = [0, 1]
    batch.kv_lens[:2] = 1
    batch.query_start_loc[1:] = [1, 2]
    batch.page_tables[0, 0], batch.page_tables[1, 0] = 1, 2
    batch.slot_mapping[:2] = [16, 32]
    batch.logits_indices[:2] = [0, 1]
    return runner.run(batch).token_ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama: the store's mechanics compiled in seconds (the default model's
    executables, with our CPU kernels' custom calls, go through the store in the first test)."""
    from tiny_models import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XLASERVE_COMPILE_CACHE", str(tmp_path))
    return tmp_path


def test_a_second_runner_loads_every_executable_and_computes_the_same(default_gguf, store_dir):
    first = ModelRunner(_config(default_gguf))
    assert first.compiles_in_child  # on CPU: the child compiles, this process loads
    first.warmup()
    assert first.num_stored_loads == len(first.config.buckets())
    expected = _step(first)
    stored = sorted(p.name for p in store_dir.rglob("*.pkl"))
    assert stored == sorted(f"{kind}-{size}.pkl" for kind, size in first.config.buckets())

    second = ModelRunner(_config(default_gguf))
    assert second.store.directory == first.store.directory
    second.warmup()
    assert second.num_stored_loads == len(second.config.buckets())
    np.testing.assert_array_equal(_step(second), expected)
    assert second.compilations_after_warmup == 0


def test_a_second_process_waits_for_the_first_to_compile_then_loads(tiny, store_dir,
                                                                     monkeypatch, caplog):
    """Two runners of one configuration starting at once (two servers, a restart): the one
    that finds the store empty second waits on the store's lock while the first compiles,
    then loads every executable instead of compiling them in a child of its own."""
    import fcntl
    import logging
    import threading

    caplog.set_level(logging.INFO, logger="engine.executable_store")
    first, second = ModelRunner(_config(tiny)), ModelRunner(_config(tiny))
    children = []
    monkeypatch.setattr(second, "_compile_in_child", children.append)
    waiting, real_flock = threading.Event(), fcntl.flock

    def flock(fd, operation):
        if threading.current_thread() is starting:
            waiting.set()  # the second runner is at the lock
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    starting = threading.Thread(target=second.warmup)
    with first.store.compiling():
        starting.start()
        assert waiting.wait(timeout=300)
        for bucket in first.config.buckets():
            first.compile_bucket(bucket)
        assert starting.is_alive()  # still held at the lock
    starting.join(timeout=300)
    assert not starting.is_alive() and second.warm
    assert children == []  # nothing left to compile once it had the lock
    assert "another process is compiling this configuration's executables" in caplog.text
    assert second.num_stored_loads == len(second.config.buckets())
    np.testing.assert_array_equal(_step(second), _step(first))


def test_another_shape_or_a_broken_file_is_compiled(tiny, store_dir, caplog):
    first = ModelRunner(_config(tiny))
    first.compile_bucket(("tokens", 2))
    other = ModelRunner(_config(tiny, max_model_len=128))  # wider page tables
    assert other.store.directory != first.store.directory
    other.compile_bucket(("tokens", 2))
    assert other.num_stored_loads == 0

    (first.store.directory / "tokens-2.pkl").write_bytes(b"not a pickle")
    again = ModelRunner(_config(tiny))
    again.compile_bucket(("tokens", 2))
    assert again.num_stored_loads == 0
    assert "ignoring stored executable" in caplog.text
    # ... and rewritten whole: the next runner loads it.
    last = ModelRunner(_config(tiny))
    last.compile_bucket(("tokens", 2))
    assert last.num_stored_loads == 1


def test_a_source_change_that_leaves_the_program_alone_loads_it(tiny, store_dir, monkeypatch):
    """Another key (here: another source digest) whose step lowers to the same program loads
    the executable stored for it and keeps a copy under its own key; a program that differs
    (wider page tables) still compiles."""
    from engine import executable_store

    first = ModelRunner(_config(tiny))
    expected = _step(first)  # compiles what the step needs, on demand
    compiled = sorted(p.name for p in first.store.directory.iterdir())
    assert first.num_stored_loads == 0 and compiled
    monkeypatch.setattr(executable_store, "_code_digest", lambda: "another source")
    changed = ModelRunner(_config(tiny))
    assert changed.store.directory != first.store.directory
    np.testing.assert_array_equal(_step(changed), expected)
    assert changed.num_stored_loads == len(compiled)  # nothing compiled
    assert sorted(p.name for p in changed.store.directory.iterdir()) == compiled
    wider = ModelRunner(_config(tiny, max_model_len=128))
    wider.compile_bucket(("tokens", 2))
    assert wider.num_stored_loads == 0
    # An index entry whose file went (pruned) is a miss: compiled and stored again.
    import shutil
    shutil.rmtree(changed.store.directory)
    shutil.rmtree(first.store.directory)
    again = ModelRunner(_config(tiny))
    again.compile_bucket(("seqs", 1))
    assert again.num_stored_loads == 0 and again.store.has(("seqs", 1))


def test_a_program_index_entry_others_could_write_is_refused(tiny, store_dir, monkeypatch,
                                                             caplog):
    from engine import executable_store

    ModelRunner(_config(tiny)).compile_bucket(("seqs", 1))
    (entry,) = (store_dir / "programs").iterdir()
    entry.chmod(0o620)
    monkeypatch.setattr(executable_store, "_code_digest", lambda: "another source")
    changed = ModelRunner(_config(tiny))
    changed.compile_bucket(("seqs", 1))
    assert changed.num_stored_loads == 0  # compiled, not loaded through the entry
    assert f"{entry} is writable by group (mode 0620)" in caplog.text


def test_auto_shares_the_steps_of_the_dtypes_it_chose(tiny, store_dir):
    """On CPU, "auto" is float32 compute and float16 pages: the same key as naming them."""
    auto = ModelRunner(_config(tiny, dtype="auto", kv_cache_dtype="auto"))
    named = ModelRunner(_config(tiny, dtype="float32", kv_cache_dtype="float16"))
    other = ModelRunner(_config(tiny, dtype="float32", kv_cache_dtype="float32"))
    assert (auto.dtype, auto.kv_dtype) == (named.dtype, named.kv_dtype)
    assert auto.store.directory == named.store.directory != other.store.directory


def test_the_task_auto_shares_the_steps_of_generate(tiny, store_dir):
    """The server resolves --task auto to generate and engine.bench leaves it auto: one key."""
    auto = ModelRunner(_config(tiny, task="auto"))
    generate = ModelRunner(_config(tiny, task="generate"))
    assert auto.store.directory == generate.store.directory


def test_no_store_when_turned_off(default_gguf, monkeypatch):
    monkeypatch.setenv("XLASERVE_COMPILE_CACHE", "off")
    assert ModelRunner(_config(default_gguf)).store is None


def test_the_least_recently_used_configurations_go_past_the_size_cap(tiny, store_dir,
                                                                        monkeypatch):
    import os

    from engine import executable_store

    dirs = []
    for i, seqs in enumerate((1, 2, 4)):
        if i == 2:  # room for the two before it and nothing more: the oldest goes
            sizes = [sum(f.stat().st_size for f in d.iterdir()) for d in dirs]
            monkeypatch.setattr(executable_store, "MAX_BYTES", sum(sizes) - 1)
        runner = ModelRunner(_config(tiny, max_num_seqs=seqs))
        runner.compile_bucket(("seqs", 1))
        os.utime(runner.store.directory, (1000 + i, 1000 + i))  # oldest first
        dirs.append(runner.store.directory)
    kept = sorted(d for d in store_dir.iterdir() if d.is_dir() and d.name != "programs")
    assert kept == sorted(dirs[1:])


def test_a_failed_child_leaves_the_compiling_here(tiny, store_dir, monkeypatch, caplog):
    import sys

    runner = ModelRunner(_config(tiny))
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the child cannot start
    runner.warmup()
    assert "compiling in a child process failed" in caplog.text
    assert runner.num_stored_loads == 0  # every executable compiled here (and stored)
    assert len(list(store_dir.rglob("*.pkl"))) == len(runner.config.buckets())
