#!/usr/bin/env bash
# The GPU tests and the GPU measurements in one call on a GPU machine. Prepare with
# benchmarks/gpu/wheels.sh where pip works, then run there from the repository root:
#
#     bash benchmarks/gpu/session.sh        (carry [".whl"], timeout_s 590)
#
# Each part has its own time limit and its own log under $OUT (its output also streams
# as it is printed), so a part that fails or runs over leaves the others' figures; no part runs past DEADLINE seconds from the
# start (a part's limit shrinks to what is left; one with under 20 s left is skipped).
# PARTS="exact_rows step_1b" runs only the parts named, in that order; by default all
# run, in the order of what matters most (ORDER below).
# Shapes: benchmarks/gpu/configs (random weights, architectures of the real models).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
CONFIGS=benchmarks/gpu/configs
START=$SECONDS
DEADLINE=${DEADLINE:-560}

part() {  # part NAME SECONDS COMMAND...: run it, log to $OUT/NAME.log, report its end
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - (SECONDS - START)))
    if ((left < 20)); then
        echo "== $name: skipped, $left s left of $DEADLINE"
        return
    fi
    ((limit > left)) && limit=$left
    local began=$SECONDS
    echo "== $name: started (limit $limit s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - began)) s (limit $limit s, $((SECONDS - START)) s in all)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# Preflight: the library and the model classes import before anything long runs.
python3 -c "import torch, transformers, genlm_backend.llm.hf, genlm_backend.llm.hf.fused; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" || exit 1

# Every test marked gpu (each file holding one is listed; tests/test_ci_readme.py checks it):
# captured steps on real CUDA graphs and the CUDA runner, every row against run_uncached.
tests() {
    part tests 200 python3 -m pytest -q -m gpu -p no:randomly -p no:cacheprovider \
        tests/test_hf_graphs.py tests/test_hf_shared_prefix.py tests/test_serve_slab.py tests/test_base.py \
        tests/test_deterministic.py tests/test_exact_fused.py tests/test_trie.py tests/test_split_level.py \
        tests/test_fused_decoder.py
}
# The fused decoder compiled for CUDA (inductor's Triton kernels), bfloat16, against the plain
# forward: the -m gpu tests of tests/test_fused_decoder.py alone (also in the tests part).
fused_tests() {
    part fused_tests 120 python3 -m pytest -q -m gpu -p no:randomly -p no:cacheprovider \
        tests/test_fused_decoder.py
}
# deterministic=True on the device: a row's bits against the row computed alone.
exact_rows() {
    part exact_rows 100 python3 benchmarks/gpu/exact_rows.py --device cuda \
        --random-weights $CONFIGS/smollm2_135m $CONFIGS/llama3_2_1b --dtypes bfloat16
}
# The same probe in the dtypes deterministic=True refuses on CUDA: is the refusal still due?
exact_rows_refused() {
    part exact_rows_refused 100 python3 benchmarks/gpu/exact_rows.py --device cuda \
        --random-weights $CONFIGS/smollm2_135m --dtypes float32 float16 --even-refused
}
# One deterministic step's attention in a layer: fused kernels, torch order, flash, the floor.
kernels() {
    part kernels_8b 60 python3 benchmarks/gpu/bench_exact_attention.py --heads 32 8 --head-dim 128
    part kernels_1b 60 python3 benchmarks/gpu/bench_exact_attention.py --heads 32 8 --head-dim 64
}
# One level's read split along its keys (its tests, against the torch reference, torch's unsplit
# attention and the runner's plain forward, run in the tests part) against one flash call and the
# floor: 8B and 1B heads, 64 rows behind levels of 1K, 4K and 16K keys; the automatic chunk and
# fixed ones.
split_level() {
    part split_level_8b 60 python3 benchmarks/gpu/bench_split_level.py --heads 32 8 --head-dim 128 \
        --keys 1024 4096 16384
    part split_level_1b 45 python3 benchmarks/gpu/bench_split_level.py --heads 32 8 --head-dim 64 \
        --keys 1024 4096 16384
}
# One draw from a 128k row on this host's CPU (a served client's draws), against the softmax formula.
sampling() { part sampling 30 python3 benchmarks/bench_sampling.py --vocab 128256 --repeats 300; }
# A batch call's auto-batching over its runner on this host's CPU (no model: the per-key cost).
batch_call() { part batch_call 30 python3 benchmarks/bench_batch_call.py --vocab 128256 --repeats 200; }
# R (the bandwidth limit), G (an engine step), G-fused (the fused decoder's step, compiled and
# captured; its first pass compiles cold on a fresh machine, bounded by --compile-deadline),
# ours drawing each particle's token on the device, ours-runner, ours with rows to the host;
# one process per shape, each figure printed as measured. step_8b_exact/step_1b_exact: the
# same with ours-runner and ours under deterministic=True (measured before: BENCHMARKS.md).
step_8b() {
    part step_8b 220 python3 benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \
        --random-weights $CONFIGS/llama3_8b --workloads 64x32@4096 --compile-deadline 150
}
step_1b() {
    part step_1b 140 python3 benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \
        --random-weights $CONFIGS/llama3_2_1b --workloads 64x32@4096 --compile-deadline 100
}
step_8b_exact() {
    part step_8b_exact 200 python3 benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \
        --random-weights $CONFIGS/llama3_8b --workloads 64x32@4096 --deterministic
}
step_1b_exact() {
    part step_1b_exact 120 python3 benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \
        --random-weights $CONFIGS/llama3_2_1b --workloads 64x32@4096 --deterministic
}
# serve's GPU leg: 4 clients x 16 particles against one process of 64, 1B shape.
serve_1b() {
    part serve_1b 150 python3 benchmarks/bench_serve.py --random-weights $CONFIGS/llama3_2_1b \
        --device cuda --dtype bfloat16 --prompt-tokens 1024 --steps 32 \
        --setups in-process served --runs ${SERVE_RUNS:-2} --repeats 10
}
# The same against an earlier commit in turns, when the call carries its checkout:
#     git worktree add .baseline <commit>, then carry [".whl", ".baseline"].
serve_1b_paired() {
    [[ -d .baseline ]] || return 0
    part serve_1b_paired 330 python3 benchmarks/bench_serve.py --random-weights $CONFIGS/llama3_2_1b \
        --device cuda --dtype bfloat16 --prompt-tokens 1024 --steps 32 \
        --setups in-process served served-before --baseline-tree .baseline \
        --runs ${SERVE_RUNS:-2} --repeats 10
}
step_smollm2() {
    part step_smollm2 45 python3 benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \
        --random-weights $CONFIGS/smollm2_135m --workloads 32x16@64
}
# Where a step of ours goes (event loop, runner, forward), 8B shape.
profile_8b() {
    part profile_8b 60 python3 benchmarks/profile_long_prompt.py --device cuda --dtype bfloat16 \
        --random-weights $CONFIGS/llama3_8b --workload 64x16@4096 --rounds 2
}
# ours against the floor in turns, one process (bench_long_prompt's --paired), 8B shape.
paired_8b() {
    part paired_8b 90 python3 benchmarks/bench_long_prompt.py --device cuda --dtype bfloat16 \
        --random-weights $CONFIGS/llama3_8b --workloads 64x16@4096 --paired 3
}

ORDER="step_8b step_1b fused_tests tests exact_rows exact_rows_refused kernels split_level step_smollm2 sampling batch_call serve_1b serve_1b_paired profile_8b paired_8b step_8b_exact step_1b_exact"
for name in ${PARTS:-$ORDER}; do
    [[ " $ORDER " == *" $name "* ]] || { echo "== $name: no such part (parts: $ORDER)"; exit 2; }
    "$name"
done
echo "== all parts done after $((SECONDS - START)) s"
