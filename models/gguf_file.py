"""Reading GGUF files: metadata as plain Python values, and tensors by name.

The `gguf` package's reader parses the file once; every error names the file (a truncated
or corrupt file fails here, not deep inside numpy). What it finds (metadata and where each
tensor's bytes lie) is kept as a JSON index in the user cache, keyed by the file's path,
size and modification time: the reader builds Python objects for every entry of the
vocabulary and merges (2.6 s for the default model on the 2-core CPU), the index loads in
a few tens of milliseconds. Tensor bytes are always read from the file itself, memory-mapped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from models.known_models import user_cache_dir
from ops.cache_trust import makedirs_private

logger = logging.getLogger(__name__)
_INDEX_VERSION = 1


class GGUFError(ValueError):
    pass


class _Reader(gguf.GGUFReader):
    """The gguf package's reader, with truncated tensor data reported by tensor name."""

    def _build_tensors(self, start_offs: int, fields) -> None:
        try:
            super()._build_tensors(start_offs, fields)
        except Exception as e:
            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_type[0])]
                end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise GGUFError(
                        f"tensor {bytes(name).decode()!r} ends at byte {end} but the file has "
                        f"{size} bytes (truncated?)") from e
            raise


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    offset: int             # of the tensor's first byte in the file
    n_bytes: int


@dataclasses.dataclass
class GGUFIndex:
    path: str
    metadata: dict[str, Any]  # every key/value field; arrays are lists, strings str
    tensors: list[TensorInfo]

    def raw(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes, memory-mapped: [n_bytes] uint8."""
        return np.memmap(self.path, np.uint8, "r", offset=tensor.offset, shape=(tensor.n_bytes,))

    def values(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order (the GGUF shape reversed)."""
        return gguf.dequantize(self.raw(tensor), tensor.tensor_type).reshape(
            tuple(reversed(tensor.shape)))


def open_gguf(path: str | Path) -> GGUFIndex:
    """The file's index, cached per (path, mtime, size) in this process and on disk."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise GGUFError(f"{path}: cannot open ({e.strerror})") from e
    return _open(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value fields of the file; arrays become lists, strings str."""
    return dict(open_gguf(path).metadata)


@lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GGUFIndex:
    key = hashlib.sha256(f"{_INDEX_VERSION}\0{path}\0{mtime_ns}\0{size}".encode()).hexdigest()
    cached = user_cache_dir() / "gguf-index" / f"{key[:32]}.json"
    try:
        entry = json.loads(cached.read_text())
        return GGUFIndex(path, entry["metadata"], [
            TensorInfo(t["name"], gguf.GGMLQuantizationType(t["type"]), tuple(t["shape"]),
                       t["offset"], t["n_bytes"]) for t in entry["tensors"]])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: parse the file
    index = _parse(path)
    try:
        makedirs_private(cached.parent)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"metadata": index.metadata, "tensors": [
                {"name": t.name, "type": int(t.tensor_type), "shape": list(t.shape),
                 "offset": t.offset, "n_bytes": t.n_bytes} for t in index.tensors]}, f)
        os.replace(tmp, cached)
    except (OSError, TypeError, ValueError) as e:  # a read-only cache, or a value JSON lacks
        logger.info("not caching the index of %s (%s)", path, e)
    return index


def _parse(path: str) -> GGUFIndex:
    try:
        reader = _Reader(path, "r")
    except Exception as e:  # the reader raises assorted errors on a bad file
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = field.contents()
        except Exception as e:
            raise GGUFError(f"{path}: cannot decode metadata field {key!r}: {e}") from e
    tensors = [TensorInfo(t.name, gguf.GGMLQuantizationType(t.tensor_type),
                          tuple(int(n) for n in t.shape), int(t.data_offset), int(t.n_bytes))
               for t in reader.tensors]
    return GGUFIndex(path, metadata, tensors)
