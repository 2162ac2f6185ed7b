#!/usr/bin/env bash
# Wheels that the lent GPU machine's image (Python 3.12, no network) lacks, at the versions
# installed here, downloaded into .whl/ (git-ignored). Carry .whl to that machine and install
# them first there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_check.py --out $OUT/gpu
set -euo pipefail
cd "$(dirname "$0")/.."
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=()
# The server imports the MCP SDK (server/mcp_endpoint.py): mcp and what it needs beyond the image.
for name in gguf starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions llguidance pytest-xdist execnet \
    mcp mcp-types anyio httpx2 httpcore2 truststore jsonschema jsonschema-specifications referencing rpds-py \
    opentelemetry-api pyjwt python-multipart sse-starlette cryptography cffi pycparser; do
  wheels+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${wheels[@]}"
ls .whl
