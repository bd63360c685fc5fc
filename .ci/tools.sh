#!/usr/bin/env bash
# The CI's own installer: uv (PyPI), in a venv of its own under $CI_TOOLS. The lint,
# client-suite and vLLM steps build their venvs with it (`ci_pip` in lib.sh): on two
# shared cores pip spent about 230 s of each step unpacking torch and the test extra, uv
# about 20 s, and a step after the first links its packages from the run's uv cache.
# The README's commands keep pip: they are what a user runs.
set -euo pipefail
"${CI_PYTHON:-python3}" -m venv "$CI_TOOLS/venv"
"$CI_TOOLS/venv/bin/pip" install -q uv
"$CI_TOOLS/venv/bin/uv" --version
