"""One level's attention in a step, split along its keys or not, against the memory floor.

R rows step one token each behind an S-token level (a prompt held once); the
8B shape's heads by default (32 query heads, 8 key/value heads, head size
128), bfloat16. The level is read once for all R x Hq queries. Ways, each
timed with CUDA graphs replayed (``triton.testing.do_bench_cudagraph``):

* ``unsplit``: what the runner did before the split (one flash call, queries
  ``[1, Hkv, R * g, D]``: ``attention.prefix_attention_with_lse``);
* ``split``: :func:`genlm_backend.llm.hf.split_level_fused.split_level_attention`
  with its own choice of chunk (the runner's path on CUDA where that choice is
  several chunks; with one, the runner keeps the unsplit call), then with each
  ``--chunk-keys`` given;
* ``floor``: the bytes the read cannot skip (the level's keys and values, the
  queries, the outputs and log-sum-exps) at the device-to-device copy
  bandwidth measured in the same run.

Each line gives the time, GB/s (floor bytes / time) and the fraction of the
copy bandwidth. The split's largest difference from the unsplit outputs and
log-sum-exps is printed first.

    python benchmarks/gpu/bench_split_level.py --rows 64 --keys 1024 4096 16384

On the CPU, as a smoke check of the script and the kernels under Triton's
interpreter (its times say nothing about a GPU; plain timing, no graphs):

    TRITON_INTERPRET=1 python benchmarks/gpu/bench_split_level.py --device cpu \\
        --rows 2 --heads 4 2 --head-dim 16 --keys 200 --dtype float32 --chunk-keys 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from genlm_backend.llm.hf.attention import prefix_attention_with_lse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="rows, one query token each")
    parser.add_argument("--keys", type=int, nargs="+", default=[4096], help="level lengths")
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chunk-keys", type=int, nargs="*", default=[256, 512, 1024, 2048])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    (num_q_heads, num_kv_heads), head_dim = args.heads, args.head_dim
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, Triton's interpreter"
    print(
        f"# {name}: {args.rows} rows x 1 token, heads {num_q_heads}/{num_kv_heads} x {head_dim}, "
        f"{args.dtype}; copy bandwidth {bandwidth / 1e9:.0f} GB/s",
        flush=True,
    )
    for num_keys in args.keys:
        measure(args, num_keys, device, dtype, bandwidth)


def measure(
    args, num_keys: int, device: torch.device, dtype: torch.dtype, bandwidth: float
) -> None:
    """Print the ways' times over one level of ``num_keys`` keys, each as it is measured."""
    from genlm_backend.llm.hf import split_level_fused

    (num_q_heads, num_kv_heads), head_dim = args.heads, args.head_dim
    num_groups = num_q_heads // num_kv_heads
    torch.manual_seed(0)
    query = torch.randn(args.rows, num_q_heads, head_dim, device=device, dtype=dtype)
    key, value = torch.randn(2, num_kv_heads, num_keys, head_dim, device=device, dtype=dtype)
    scale = head_dim**-0.5
    # the unsplit layout: [1, Hkv, R * g, D], each key/value head's queries together
    grouped = query.view(args.rows, num_kv_heads, num_groups, head_dim).transpose(0, 1)
    grouped = grouped.reshape(1, num_kv_heads, -1, head_dim)
    ways = {
        "unsplit": lambda: prefix_attention_with_lse(grouped, key[None], value[None], scale),
        "split (auto)": lambda: split_level_fused.split_level_attention(query, key, value, scale),
    }
    for chunk in args.chunk_keys:
        ways[f"split {chunk} keys"] = lambda chunk=chunk: split_level_fused.split_level_attention(
            query, key, value, scale, chunk
        )
    num_bytes = 2 * key.numel() * key.element_size() + 2 * query.numel() * query.element_size()
    num_bytes += query.numel() // head_dim * 4  # the log-sum-exps, float32
    split = describe_split(args.rows * num_groups, num_kv_heads, num_keys, head_dim, device)
    print(
        f"S={num_keys}: {split}; {differences(ways, args.rows, num_kv_heads, num_groups, head_dim)}; "
        f"floor {num_bytes / 1e6:.1f} MB = {num_bytes / bandwidth * 1e6:.1f} us",
        flush=True,
    )
    for label, way in ways.items():
        seconds = time_of(way, device)
        rate = num_bytes / seconds
        print(
            f"S={num_keys} {label}: {seconds * 1e6:.1f} us, {rate / 1e9:.0f} GB/s "
            f"({rate / bandwidth:.0%} of the copy bandwidth)",
            flush=True,
        )


def describe_split(num_queries, num_kv_heads, num_keys, head_dim, device) -> str:
    """The automatic choice: keys a chunk, chunks, programs."""
    from genlm_backend.llm.hf import split_level_fused

    split = split_level_fused.plan_split(num_queries, num_kv_heads, num_keys, head_dim, device)
    num_programs = split.num_query_blocks * num_kv_heads * split.num_chunks
    return (
        f"auto: {split.num_chunks} chunks of up to {split.chunk_keys} keys, {num_programs} programs "
        f"of {split.block_queries} queries x {split.block_keys} keys on "
        f"{split_level_fused._num_sms(device)} SMs"
    )


def differences(ways, num_rows, num_kv_heads, num_groups, head_dim) -> str:
    """The largest difference of each split from the unsplit outputs and log-sum-exps."""
    output, lse = ways["unsplit"]()
    # [1, Hkv, R * g, ...] -> [R, Hq, ...]
    output = output[0].view(num_kv_heads, num_rows, num_groups, head_dim).transpose(0, 1)
    output = output.reshape(num_rows, -1, head_dim).float()
    lse = lse[0].view(num_kv_heads, num_rows, num_groups).transpose(0, 1).reshape(num_rows, -1)
    worst_output = worst_lse = 0.0
    for label, way in ways.items():
        if label != "unsplit":
            split_output, split_lse = way()
            worst_output = max(worst_output, (split_output.float() - output).abs().max().item())
            worst_lse = max(worst_lse, (split_lse - lse.float()).abs().max().item())
    return (
        f"split vs unsplit: outputs within {worst_output:.3g}, log-sum-exps within {worst_lse:.3g}"
    )


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second a copy of 1 GiB (CUDA; 16 MiB on the CPU) reads plus writes: the floor's rate."""
    num_bytes = 1 << 30 if device.type == "cuda" else 1 << 24
    source = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    return 2 * num_bytes / time_of(lambda: target.copy_(source), device, graphs=False)


def time_of(way, device: torch.device, graphs: bool = True) -> float:
    """Median seconds of a call: CUDA graphs replayed on a GPU, plain calls on the CPU."""
    if device.type == "cuda":
        import triton.testing

        bench = triton.testing.do_bench_cudagraph if graphs else triton.testing.do_bench
        return bench(way, return_mode="median") / 1e3
    way()  # warm-up
    times = []
    for _ in range(3):
        began = time.perf_counter()
        way()
        times.append(time.perf_counter() - began)
    return sorted(times)[1]


if __name__ == "__main__":
    main()
