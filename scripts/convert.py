"""Convert a GGUF file or HF directory into an xlaserve Orbax checkpoint (fast reloads).

Usage: python scripts/convert.py SRC DST [--dtype float32|bfloat16]
       [--quantization int8|int4|w8a8]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.convert import convert  # noqa: E402
from ops.quantization import CHOICES  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="GGUF file or HF model directory")
    parser.add_argument("dst", help="output checkpoint directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", choices=CHOICES, default="auto",
                        help="as the server's: auto stores a GGUF's quantized blocks as "
                             "they are, none stores float, int8/int4 quantize")
    args = parser.parse_args()
    convert(args.src, args.dst, args.dtype, args.quantization)
    print(args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
