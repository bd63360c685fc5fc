#!/usr/bin/env bash
# Creates the baseline virtualenv with upstream genlm-backend 0.3.1 (if missing):
#   ${UPSTREAM_VENV:-/work/venvs/upstream}
# It holds the CPU build of torch 2.13.0, installed first and then pinned by a
# constraints file so that no dependency can swap it for a CUDA build, and
# genlm-backend 0.3.1 with its required dependencies (transformers 5, numba,
# accelerate, ...), enough for its TokenCharacterTrie family and AsyncTransformer.
# vLLM (an optional extra upstream) is never installed.
#
# Usage: bash benchmarks/upstream_env.sh      (prints the venv's python on success)
set -euo pipefail

VENV="${UPSTREAM_VENV:-/work/venvs/upstream}"
TORCH_VERSION="2.13.0"
TRANSFORMERS_VERSION="5.19.0"  # the version installed system-wide
PYTHON="$VENV/bin/python"

is_complete() {
    [ -x "$PYTHON" ] && "$PYTHON" - <<EOF 2>/dev/null
import importlib.metadata as md, importlib.util, torch
assert md.version("genlm-backend") == "0.3.1"
assert torch.__version__.startswith("$TORCH_VERSION") and not torch.version.cuda
assert importlib.util.find_spec("vllm") is None
from genlm.backend.trie import ParallelTokenCharacterTrie
from genlm.backend.llm import AsyncTransformer
EOF
}

if is_complete; then
    echo "$PYTHON"
    exit 0
fi

if [ ! -x "$PYTHON" ]; then
    python3.11 -m venv "$VENV"
fi
"$PYTHON" -m pip install --quiet --upgrade pip

# 1. torch first: the local CPU wheel when present, else the CPU index.
cpu_wheel=$(ls /opt/wheels/torch-${TORCH_VERSION}+cpu-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$cpu_wheel" ]; then
    "$PYTHON" -m pip install --quiet "$cpu_wheel"
else
    "$PYTHON" -m pip install --quiet "torch==${TORCH_VERSION}" \
        --index-url https://download.pytorch.org/whl/cpu
fi
installed_torch=$("$PYTHON" -c "import torch; print(torch.__version__)")

# 2. genlm-backend, with torch pinned to the build just installed.
constraints="$VENV/constraints.txt"
cat > "$constraints" <<EOF
torch==${installed_torch}
transformers==${TRANSFORMERS_VERSION}
EOF
"$PYTHON" -m pip install --quiet -c "$constraints" "genlm-backend==0.3.1"

if ! is_complete; then
    echo "upstream_env.sh: $VENV is incomplete (torch changed, vllm present or imports fail)" >&2
    exit 1
fi
echo "$PYTHON"
