"""One layer's attention in a deterministic step, three ways, against the memory floor.

P rows step one token each behind a T-token prompt read as a level (held
once), each with an own part of O keys; the 8B shape's heads by default
(32 query heads, 8 key/value heads, head size 128), bfloat16. Times, with
CUDA graphs replayed (``triton.testing.do_bench_cudagraph``):

* ``fused``: :func:`genlm_backend.llm.hf.exact.fused.fused_exact_attention`
  (the fixed fold, two kernels);
* ``torch``: :func:`genlm_backend.llm.hf.exact.exact_attention`'s torch
  operations (the other fixed order);
* ``sdpa``: one fused flash kernel over each row's whole context, not
  exact (every row's prompt copied beside its own part: what the floor
  would be without levels);
* ``floor``: the bytes a layer must read (the level's keys and values once,
  every own part, the queries) at the copy bandwidth measured in the same run.

    python benchmarks/gpu/bench_exact_attention.py --rows 64 --prompt 4096 --own 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from genlm_backend.llm.hf import exact
from genlm_backend.llm.hf.attention import Level


def copy_bandwidth(num_bytes: int) -> float:
    """Bytes a second a device-to-device copy of ``num_bytes`` reads plus writes (the floor's rate)."""
    import triton.testing

    source = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), return_mode="median")
    return 2 * num_bytes / (ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=4096, help="level length (a multiple of 256)")
    parser.add_argument("--own", type=int, default=64, help="own slots per row")
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    import triton.testing

    from genlm_backend.llm.hf.exact.fused import fused_exact_attention

    dtype = getattr(torch, args.dtype)
    rows, (num_q, num_kv), dim = args.rows, args.heads, args.head_dim
    torch.manual_seed(0)
    cuda = dict(device="cuda", dtype=dtype)
    query = torch.randn(rows, num_q, 1, dim, **cuda)
    level_kv = torch.randn(2, 1, num_kv, args.prompt, dim, **cuda)
    own_kv = torch.randn(2, rows, num_kv, args.own, dim, **cuda)
    block = SimpleNamespace(layers=[(level_kv[0], level_kv[1])])
    level = Level(block, row=0, start=0, length=args.prompt, rows=None)
    writes = torch.randint(args.own // 2, args.own, (rows,), device="cuda")
    layout = exact.ExactLayout.of_step(
        splits=torch.full((rows,), args.prompt, device="cuda"),
        firsts=torch.zeros(rows, dtype=torch.long, device="cuda"),
        writes=writes,
        levels=[(level, 0)],
        num_groups=num_q // num_kv,
        num_slots=args.own,
    )
    scale = dim**-0.5
    whole = torch.cat([level_kv.expand(-1, rows, -1, -1, -1), own_kv], dim=3)  # [2, B, Hkv, T+O, D]
    ways = {
        "fused": lambda: fused_exact_attention(0, query, own_kv[0], own_kv[1], scale, layout),
        "torch": lambda: exact.exact_attention(
            0,
            query,
            own_kv[0],
            own_kv[1],
            scale,
            layout,
            own=exact._own_blocks(own_kv[0], own_kv[1], layout),
        ),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            query, whole[0], whole[1], scale=scale, enable_gqa=True
        ),
    }
    fused, torch_order = ways["fused"](), ways["torch"]()
    difference = (fused.float() - torch_order.float()).abs().max().item()
    num_bytes = level_kv.numel() * level_kv.element_size() + own_kv.numel() * own_kv.element_size()
    num_bytes += 2 * query.numel() * query.element_size()
    bandwidth = copy_bandwidth(1 << 30)
    floor_us = num_bytes / bandwidth * 1e6
    print(
        f"# {torch.cuda.get_device_name()}: {rows} rows x 1 token behind {args.prompt} "
        f"(a level) + {args.own} own slots, heads {num_q}/{num_kv} x {dim}, {args.dtype}; "
        f"fused vs torch order: largest difference {difference:.3g}",
        flush=True,
    )
    print(
        f"floor: {num_bytes / 1e6:.1f} MB at {bandwidth / 1e12:.2f} TB/s = {floor_us:.1f} us",
        flush=True,
    )
    for name, way in ways.items():
        us = triton.testing.do_bench_cudagraph(way, return_mode="median") * 1e3
        print(f"{name}: {us:.1f} us a layer ({us / floor_us:.1f}x the floor)", flush=True)


if __name__ == "__main__":
    main()
