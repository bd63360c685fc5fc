#!/usr/bin/env bash
# Creates the virtualenv of upstream genlm-backend 0.3.1 with its MLX extra (if missing):
#   ${UPSTREAM_MLX_VENV:-/work/venvs/upstream-mlx}
# As benchmarks/upstream_env.sh, plus MLX: torch 2.13.0's CPU build first, pinned by a
# constraints file; then genlm-backend[mlx]==0.3.1 and mlx[cpu] (upstream's extra asks for
# plain `mlx`, which on Linux installs no backend and fails to import), the same MLX build as
# this project's venv, with mlx-lm 0.31.3: upstream imports private helpers of
# mlx_lm.generate (`_left_pad_prompts`, `_make_cache`) that mlx-lm 0.32 removed, and
# then silently falls back to its placeholder class, which says MLX is not installed.
#
# Usage: bash benchmarks/upstream_mlx_env.sh      (prints the venv's python on success)
set -euo pipefail

VENV="${UPSTREAM_MLX_VENV:-/work/venvs/upstream-mlx}"
TORCH_VERSION="2.13.0"
TRANSFORMERS_VERSION="5.19.0"
MLX_VERSION="0.32.4"
MLX_LM_VERSION="0.31.3"
PYTHON="$VENV/bin/python"

is_complete() {
    [ -x "$PYTHON" ] && "$PYTHON" - <<PYEOF 2>/dev/null
import importlib.metadata as md, torch
assert md.version("genlm-backend") == "0.3.1"
assert md.version("mlx") == "$MLX_VERSION" and md.version("mlx-lm") == "$MLX_LM_VERSION"
assert torch.__version__.startswith("$TORCH_VERSION") and not torch.version.cuda
import mlx.core
from genlm.backend.llm.mlx import AsyncMlxLM, HAS_MLX
assert HAS_MLX
PYEOF
}

if is_complete; then
    echo "$PYTHON"
    exit 0
fi
if [ ! -x "$PYTHON" ]; then
    python3.11 -m venv "$VENV"
fi
"$PYTHON" -m pip install --quiet --upgrade pip

cpu_wheel=$(ls /opt/wheels/torch-${TORCH_VERSION}+cpu-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$cpu_wheel" ]; then
    "$PYTHON" -m pip install --quiet "$cpu_wheel"
else
    "$PYTHON" -m pip install --quiet "torch==${TORCH_VERSION}" \
        --index-url https://download.pytorch.org/whl/cpu
fi
installed_torch=$("$PYTHON" -c "import torch; print(torch.__version__)")

constraints="$VENV/constraints.txt"
cat > "$constraints" <<PINS
torch==${installed_torch}
transformers==${TRANSFORMERS_VERSION}
mlx==${MLX_VERSION}
mlx-lm==${MLX_LM_VERSION}
PINS
"$PYTHON" -m pip install --quiet -c "$constraints" "genlm-backend[mlx]==0.3.1" "mlx[cpu]"

if ! is_complete; then
    echo "upstream_mlx_env.sh: $VENV is incomplete (torch changed or MLX imports fail)" >&2
    exit 1
fi
echo "$PYTHON"
