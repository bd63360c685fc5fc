#!/usr/bin/env bash
# ruff (lint and format check) over the whole tree and mypy over the package,
# at the versions pinned in the `lint` extra, in their own venv.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
fresh_venv
pip install -q -e ".[lint]"
ruff check .
ruff format --check .
mypy
