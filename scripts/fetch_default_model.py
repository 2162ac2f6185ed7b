"""Download the default model (SmolLM2-135M-Instruct GGUF) into the user cache.

Usage: python scripts/fetch_default_model.py   (prints the file's path)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.default_model import FetchError, fetch_default_model  # noqa: E402


def main() -> int:
    try:
        print(fetch_default_model())
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
