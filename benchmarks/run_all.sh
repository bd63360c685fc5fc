#!/usr/bin/env bash
# Every benchmark, one after the other, on an otherwise idle machine; each
# table goes to benchmarks/results/<name>.md (pasted into BENCHMARKS.md).
#   bash benchmarks/run_all.sh            # about an hour on 2 CPU cores (upstream at 64x128 takes ~20 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
upstream_python=$(bash benchmarks/upstream_env.sh | tail -n 1)

python benchmarks/bench_attention.py | tee "$out/attention.md"
python benchmarks/bench_hf.py --workloads 16x32 --repeats 5 \
    --variants floor ours ours+in_loop upstream+cache_kv | tee "$out/hf_16x32.md"
python benchmarks/bench_request_host.py --lengths 64 1024 4097 | tee "$out/request_host.md"
python benchmarks/bench_output_cache.py | tee "$out/output_cache.md"
python benchmarks/bench_head.py | tee "$out/head.md"
python benchmarks/bench_hf.py --workloads 64x128 --repeats 3 --variants floor ours --batch-size 64 | tee "$out/hf_64x128_b64.md"
OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000 python benchmarks/bench_hf.py --workloads 64x128 --repeats 3 \
    --variants floor ours --batch-size 64 | tee "$out/hf_64x128_b64_omp.md"
python benchmarks/bench_hf.py --workloads 64x128 --repeats 1 --variants floor ours | tee "$out/hf_64x128_default.md"
python benchmarks/bench_hf.py --workloads 64x128 --repeats 1 --variants floor ours upstream+cache_kv | tee "$out/hf_64x128.md"
python benchmarks/bench_hf.py --workloads 1x32 4x32 16x32 64x32 --repeats 1 \
    --variants floor ours upstream+cache_kv --json "$out/hf_sweep.json" | tee "$out/hf_sweep.md"
python benchmarks/plot_hf.py "$out/hf_sweep.json" benchmarks/hf_time_vs_particles.png
python benchmarks/bench_long_prompt.py --workloads 32x16@1024 32x16@4096 --paired 5 | tee "$out/long_prompt_paired.md"
python benchmarks/bench_long_prompt.py --workloads 32x16@1024 32x16@4096 \
    --variants floor ours ncopies upstream --upstream-python "$upstream_python" | tee "$out/long_prompt.md"
bash benchmarks/upstream_mlx_env.sh > /dev/null
python benchmarks/bench_mlx.py --workloads 16x32@25 --repeats 3 | tee "$out/mlx.md"
python benchmarks/bench_mlx.py --workloads 32x16@1024 --repeats 2 | tail -n 4 | tee -a "$out/mlx.md"
python benchmarks/bench_mlx.py --workloads 16x8@25~2 --variants ours upstream hf --repeats 1 | tail -n 3 | tee -a "$out/mlx.md"
python benchmarks/bench_trie.py --vocab smollm2 qwen3 --threads 2 | tee "$out/trie_2threads.md"
python benchmarks/bench_trie.py --vocab smollm2 qwen3 --threads 1 | tee "$out/trie_1thread.md"
python benchmarks/bench_vocab.py | tee "$out/vocab.md"
python benchmarks/bench_transport.py | tee "$out/transport.md"
python benchmarks/bench_serve.py --particles 16 --steps 16 --runs 5 --plot benchmarks/serve.png | tee "$out/serve.md"
python benchmarks/bench_vllm.py | tee "$out/vllm.md"
python benchmarks/bench_vllm.py --steps 8 | tee "$out/vllm_8steps.md"
python benchmarks/bench_vllm_long_prompt.py --repeats 3 | tee "$out/vllm_long_prompt.md"
python -m pytest tests/stress -q -p no:cacheprovider 2>&1 | tail -25 | tee "$out/stress.md"
