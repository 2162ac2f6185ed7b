"""The GGUF index (metadata and tensor locations) is cached on disk per file version and gives
exactly what parsing the file gives."""

from __future__ import annotations

import shutil

import gguf
import numpy as np

from models import gguf_file


def test_the_cached_index_equals_a_fresh_parse(default_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_gguf, copy)
    gguf_file._open.cache_clear()
    parsed = gguf_file.open_gguf(copy)
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 1
    gguf_file._open.cache_clear()
    cached = gguf_file.open_gguf(copy)  # from the JSON file now
    assert cached.metadata == parsed.metadata and cached.tensors == parsed.tensors
    assert cached.metadata["general.architecture"] == "llama"

    reader = gguf.GGUFReader(copy)
    for ours, theirs in zip(cached.tensors, reader.tensors, strict=True):
        assert ours.name == theirs.name and ours.tensor_type == theirs.tensor_type
        np.testing.assert_array_equal(cached.raw(ours), np.asarray(theirs.data).view(np.uint8)
                                      .reshape(-1))

    # Another version of the file (here: a byte appended) is parsed again, not served stale.
    with open(copy, "ab") as f:
        f.write(b"\0")
    gguf_file._open.cache_clear()
    gguf_file.open_gguf(copy)
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 2
    gguf_file._open.cache_clear()
