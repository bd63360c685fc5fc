#!/usr/bin/env bash
# Creates (if missing) the two virtualenvs that bench_genlm_control.py compares:
#   ${CONTROL_OURS_VENV:-/work/venvs/smc}: genlm_backend from this checkout (editable, test
#       extra) with genlm-control 0.4.1 and genlm-bytes 0.2.0 installed without their
#       dependencies (which would pull upstream genlm-backend), plus their other dependencies;
#   ${UPSTREAM_VENV:-/work/venvs/upstream-smc}: benchmarks/upstream_env.sh's venv plus
#       genlm-control 0.4.1 with its dependencies, torch and transformers pinned.
# Both get torch 2.13.0's CPU build first. Prints the two pythons (ours, then upstream).
#
# Usage: bash benchmarks/genlm_control_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OURS_VENV="${CONTROL_OURS_VENV:-/work/venvs/smc}"
export UPSTREAM_VENV="${UPSTREAM_VENV:-/work/venvs/upstream-smc}"
TORCH_VERSION="2.13.0"
CONTROL_DEPS=(genlm-grammar==0.2.0 arsenal IPython json-stream "jsonschema[format-nongpl]" regex)

control_imports() {  # $1: python; $2: 1 to install the alias first
    "$1" - "$2" <<'EOF' 2>/dev/null
import sys
if sys.argv[1] == "1":
    import genlm_backend.alias
    genlm_backend.alias.install()
import genlm.backend, genlm.control
assert (genlm.backend.__name__ == "genlm_backend") == (sys.argv[1] == "1")
EOF
}

install_cpu_torch() {  # $1: python
    local wheel
    wheel=$(ls /opt/wheels/torch-${TORCH_VERSION}+cpu-*.whl 2>/dev/null | head -n 1 || true)
    if [ -n "$wheel" ]; then
        "$1" -m pip install --quiet "$wheel"
    else
        "$1" -m pip install --quiet "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
    fi
}

ours_python="$OURS_VENV/bin/python"
if ! control_imports "$ours_python" 1; then
    [ -x "$ours_python" ] || python3.11 -m venv "$OURS_VENV"
    "$ours_python" -m pip install --quiet --upgrade pip
    install_cpu_torch "$ours_python"
    "$ours_python" -m pip install --quiet -e ".[test]"
    "$ours_python" -m pip install --quiet --no-deps genlm-control==0.4.1 genlm-bytes==0.2.0
    "$ours_python" -m pip install --quiet "${CONTROL_DEPS[@]}"
    control_imports "$ours_python" 1 || { echo "genlm_control_env.sh: $OURS_VENV is incomplete" >&2; exit 1; }
fi

upstream_python=$(bash benchmarks/upstream_env.sh | tail -n 1)
if ! control_imports "$upstream_python" 0; then
    "$upstream_python" -m pip install --quiet -c "$UPSTREAM_VENV/constraints.txt" genlm-control==0.4.1
    control_imports "$upstream_python" 0 || { echo "genlm_control_env.sh: $UPSTREAM_VENV is incomplete" >&2; exit 1; }
fi
echo "$ours_python"
echo "$upstream_python"
