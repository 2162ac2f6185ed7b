"""Reading GGUF files: metadata as plain Python values, and tensors by name.

Thin wrapper over the `gguf` package's memory-mapped reader; every error names
the file (a truncated or corrupt file fails here, not deep inside numpy).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf


class GGUFError(ValueError):
    pass


@lru_cache(maxsize=4)
def open_gguf(path: str | Path) -> gguf.GGUFReader:
    path = str(path)
    try:
        return gguf.GGUFReader(path, "r")
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
