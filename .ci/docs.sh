#!/usr/bin/env bash
# The documentation site builds with no warnings (mkdocs --strict), in its own venv.
set -euo pipefail
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"${CI_PYTHON:-python3}" -m venv "$work/venv"
. "$work/venv/bin/activate"
pip install -q torch==2.13.0
pip install -q -e ".[docs]"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$work/site"
