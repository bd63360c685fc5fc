#!/usr/bin/env bash
# The documentation site builds with no warnings (mkdocs --strict), in its own venv.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
fresh_venv
pip install -q -e ".[docs]"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$work/site"
