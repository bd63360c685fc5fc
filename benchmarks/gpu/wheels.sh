#!/usr/bin/env bash
# Run where pip reaches PyPI, from the repository root, before a device call:
# downloads into .whl/ (git-ignored) the packages the GPU image lacks or holds too old
# (its Python 3.12 has torch and transformers 5.17; we need transformers >= 5.19, and
# its regex may be older than transformers 5.23 asks).
# session.sh installs them there. About 15 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    transformers==5.23.0 pytest-asyncio==1.5.0 gguf==0.19.0 graphviz==0.21 \
    uvicorn==0.54.0 httptools==0.9.0 regex==2026.11.19
ls -la .whl
