"""Progress bars for long host-side work (weight loading, warmup): shown on a terminal,
hidden in logs and CI, and off with XLASERVE_NO_PROGRESS=1."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def progress_bar(iterable=None, **kwargs) -> tqdm:
    hidden = not sys.stderr.isatty() or bool(os.environ.get("XLASERVE_NO_PROGRESS"))
    return tqdm(iterable, disable=hidden, **kwargs)
