"""Reading GGUF files: metadata as plain Python values, and tensors by name.

Thin wrapper over the `gguf` package's memory-mapped reader; every error names
the file (a truncated or corrupt file fails here, not deep inside numpy).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np


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


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A memory-mapped reader, cached per (path, mtime, size)."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise GGUFError(f"{path}: cannot open ({e.strerror})") from e
    return _open(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    try:
        return _Reader(path, "r")
    except Exception as e:  # the reader raises assorted errors on a bad file
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def read_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value fields of the file; arrays become lists, strings str."""
    reader = open_gguf(path)
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception as e:
            raise GGUFError(f"{path}: cannot decode metadata field {key!r}: {e}") from e
    return out
