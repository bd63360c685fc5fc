#!/usr/bin/env bash
# ruff (lint and format check) over the whole tree, mypy over the package, and the
# documentation site (mkdocs --strict, no warnings), at the versions pinned in the
# `lint` and `docs` extras, in one venv of their own.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
fresh_venv
# One venv for both: the project and its dependencies install once.
ci_pip "$(command -v python)" install -q -e ".[lint,docs]"
ruff check .
ruff format --check .
mypy
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$work/site"
