#!/usr/bin/env bash
# The GPU tests and the GPU step measurements in one call on a GPU machine (the parts'
# limits add up to 500 s; not yet timed on a GPU). Prepare with
# benchmarks/gpu/wheels.sh where pip works, then run there from the repository root:
#
#     bash benchmarks/gpu/session.sh        (carry [".whl"], timeout_s 590)
#
# Each part has its own time limit and its own log under $OUT, so a part that fails or
# runs over leaves the others' figures. Parts run in the order of what matters most.
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

part() {  # part NAME SECONDS COMMAND...: run it, log to $OUT/NAME.log, report its end
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - began)) s (limit $limit s, $((SECONDS - START)) s in all)"
    tail -n 25 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

# Captured steps on real CUDA graphs, every row against run_uncached.
part tests 90 python3 -m pytest -q -x -m gpu -p no:randomly -p no:cacheprovider \
    tests/test_hf_graphs.py
# R (the bandwidth limit), G (an engine step), ours-runner and ours, one process per workload.
part step_8b 170 python3 benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \
    --random-weights $CONFIGS/llama3_8b --workloads 64x32@4096
part step_1b 90 python3 benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \
    --random-weights $CONFIGS/llama3_2_1b --workloads 64x32@4096
part step_smollm2 60 python3 benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \
    --random-weights $CONFIGS/smollm2_135m --workloads 32x16@64
# Where a step of ours goes (event loop, runner, forward), 8B shape.
part profile_8b 90 python3 benchmarks/profile_long_prompt.py --device cuda --dtype bfloat16 \
    --random-weights $CONFIGS/llama3_8b --workload 64x16@4096 --rounds 2
echo "== all parts done after $((SECONDS - START)) s"
