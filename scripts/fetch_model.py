"""Download a known model (default: SmolLM2-135M-Instruct) into the user cache.

Usage: python scripts/fetch_model.py [NAME]   (prints the file's path)
       python scripts/fetch_model.py --list   (the known names)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.known_models import DEFAULT_MODEL, KNOWN_MODELS, FetchError, fetch_model  # noqa: E402


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        for m in KNOWN_MODELS.values():
            print(f"{m.name}\t{m.served_name}" + (f"\t({m.terms})" if m.terms else ""))
        return 0
    try:
        print(fetch_model(argv[0] if argv else DEFAULT_MODEL))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
