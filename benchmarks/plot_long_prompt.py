"""Plot step time against prompt length from ``bench_long_prompt.py --json`` outputs.

One panel per JSON file (e.g. CPU and CUDA), the workloads of one particle
count and step count (``--shape``, default 32x16) on the x axis by prompt
length, one line per variant::

    python benchmarks/bench_long_prompt.py --workloads 32x16@64 32x16@1024 32x16@4096 --json cpu.json
    python benchmarks/plot_long_prompt.py cpu.json:"CPU, 2 threads" cuda.json:"H100" \\
        --out benchmarks/long_prompt.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LABELS = {
    "ours": "genlm_backend AsyncTransformer",
    "floor": "compute floor (64-token steps + prompt attention once)",
    "ncopies": "N-copies DynamicCache loop",
    "upstream": "upstream 0.3.1 + cache_kv",
}


def series(results: list[dict], shape: str) -> dict[str, list[tuple[int, float]]]:
    """``variant -> [(prompt tokens, steps seconds)]`` for the workloads of ``shape``."""
    lines = defaultdict(list)
    for result in results:
        workload_shape, prompt = result["workload"].split("@")
        if workload_shape == shape and "steps_s" in result:
            lines[result["variant"]].append((int(prompt), result["steps_s"]))
    return {variant: sorted(points) for variant, points in lines.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("panels", nargs="+", help="FILE.json or FILE.json:TITLE")
    parser.add_argument("--shape", default="32x16", help="particles x steps to plot")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    figure, axes = plt.subplots(1, len(args.panels), figsize=(5.5 * len(args.panels), 4.2))
    axes = [axes] if len(args.panels) == 1 else list(axes)
    for axis, panel in zip(axes, args.panels):
        path, _, title = panel.partition(":")
        for variant, points in series(json.loads(Path(path).read_text()), args.shape).items():
            prompts, seconds = zip(*points)
            axis.plot(prompts, seconds, marker="o", label=LABELS.get(variant, variant))
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("shared prompt tokens")
        axis.set_ylabel(f"seconds for {args.shape.split('x')[1]} steps")
        axis.set_title(f"{title or path}: {args.shape.split('x')[0]} particles")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
