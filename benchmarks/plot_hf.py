"""Plot seconds vs particles from ``bench_hf.py --json`` output.

python benchmarks/bench_hf.py --workloads 1x32 4x32 16x32 64x32 --json hf.json
python benchmarks/plot_hf.py hf.json benchmarks/hf_time_vs_particles.png
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LABELS = {
    "ours": "genlm_backend AsyncTransformer",
    "floor": "floor: plain batched decode loop",
    "upstream": "upstream genlm-backend 0.3.1",
    "upstream+cache_kv": "upstream genlm-backend 0.3.1 + cache_kv",
}


def main(source: str, target: str) -> None:
    results = json.loads(Path(source).read_text())
    series = defaultdict(list)
    steps = set()
    for r in results:
        if "seconds" not in r:
            continue
        particles, num_steps = map(int, r["workload"].split("x"))
        steps.add(num_steps)
        series[r["variant"]].append((particles, r["seconds"]))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for variant, points in series.items():
        points.sort()
        ax.plot(*zip(*points), marker="o", label=LABELS.get(variant, variant))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("particles")
    ax.set_ylabel("seconds")
    ax.set_title(f"SmolLM2-135M fp32, 2 CPU threads, {'/'.join(map(str, sorted(steps)))} steps")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
