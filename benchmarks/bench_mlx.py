"""Particles on MLX's CPU build: AsyncMlxLM vs upstream's AsyncMlxLM vs a plain MLX loop vs our HF backend.

Workload ``PxS@T``: P particles behind one T-token prompt take S steps, one
``await next_token_logprobs`` per particle per step (``16x32@25`` is
bench_hf's shape, ``32x16@1024`` bench_long_prompt's); ``PxS@T~K``: odd
particles append K tokens a step (a particle that extends by a multi-token
unit, e.g. a word, while others extend by one). Token ids are seeded
random draws, the same for every variant, and particle i's first own token
differs from every other particle's, so no step is deduplicated: each step
asks for P distinct rows. The prompt's prefill (its first request) is timed
apart from the steps. SmolLM2-135M-Instruct in float32. Variants, each in its
own process, run in turns (``--repeats``), medians reported:

* ``ours``: ``genlm_backend.llm.mlx.AsyncMlxLM.from_name`` on default settings.
* ``upstream``: genlm-backend 0.3.1's ``AsyncMlxLM.from_name`` on its
  defaults, from its own virtualenv (``benchmarks/upstream_mlx_env.sh``), on
  a copy of the model folder whose ``config.json`` has ``rope_theta`` at the
  top level (``mlx_lm.load`` misreads the original; the speed is the same).
* ``mlx-floor``: a plain batched mlx-lm decode loop: the prompt's keys/values
  computed once and copied into P rows of mlx-lm's ``KVCache``, then one
  forward of P tokens per step (no cache lookups, no batcher).
* ``hf``: ``genlm_backend.llm.hf.AsyncTransformer`` on default settings
  (torch, 2 threads), same machine.

Usage::

    python benchmarks/bench_mlx.py                                  # three workloads, every variant
    python benchmarks/bench_mlx.py --workloads 16x32@25 --variants ours mlx-floor --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
UPSTREAM_PYTHON = (
    Path(os.environ.get("UPSTREAM_MLX_VENV", "/work/venvs/upstream-mlx")) / "bin" / "python"
)
WORKLOADS = ("16x32@25", "32x16@1024", "16x8@25~2")
VARIANTS = ("ours", "upstream", "mlx-floor", "hf")
VOCAB = 49_152


def parse_workload(text: str) -> tuple[int, int, int, int]:
    """``PxS@T`` or ``PxS@T~K`` -> (P, S, T, K): with ``~K``, odd particles take K tokens a step."""
    shape, prompt = text.split("@")
    particles, steps = shape.split("x")
    prompt, _, uneven = prompt.partition("~")
    return int(particles), int(steps), int(prompt), int(uneven or 1)


def token_draws(particles: int, steps: int, prompt_tokens: int, uneven: int = 1, seed: int = 0):
    """The prompt, and each particle's tokens step by step (its first token distinct across particles)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(prompt_tokens)]
    firsts = rng.sample(range(1, VOCAB), particles)
    own = []
    for i, first in enumerate(firsts):
        per_step = uneven if i % 2 else 1
        draws = [first] + [rng.randrange(1, VOCAB) for _ in range(steps * per_step - 1)]
        own.append([draws[k : k + per_step] for k in range(0, len(draws), per_step)])
    return prompt, own


def run_particles(llm, prompt, own, warm_up) -> dict:
    """Time the prompt's request, then the particles' steps, on any AsyncLM-like object."""
    import asyncio

    warm_up()

    async def particle(steps):
        context = list(prompt)
        for tokens in steps:
            context.extend(tokens)
            await llm.next_token_logprobs(context)

    async def main():
        start = time.perf_counter()
        await llm.next_token_logprobs(prompt)
        prompt_s = time.perf_counter() - start
        start = time.perf_counter()
        await asyncio.gather(*(particle(tokens) for tokens in own))
        return prompt_s, time.perf_counter() - start

    prompt_s, steps_s = asyncio.run(main())
    return {"prompt_s": prompt_s, "steps_s": steps_s}


def run_ours(model_dir, prompt, own) -> dict:
    from genlm_backend.llm.mlx import AsyncMlxLM

    llm = AsyncMlxLM.from_name(model_dir)
    result = run_particles(llm, prompt, own, lambda: llm.next_token_logprobs_uncached([1, 2, 3]))
    stats = llm.stats
    return result | {
        "tokens_computed": stats.num_tokens_computed,
        "tokens_requested": stats.num_tokens_requested,
        "mean_batch": round(stats.mean_batch_size, 1),
    }


def run_hf(model_dir, prompt, own) -> dict:
    import torch

    from genlm_backend.llm.hf import AsyncTransformer

    torch.set_num_threads(2)
    llm = AsyncTransformer.from_name(model_dir)
    return run_particles(llm, prompt, own, lambda: llm.next_token_logprobs_uncached([1, 2, 3]))


def run_upstream(model_dir, prompt, own) -> dict:
    from genlm.backend.llm import AsyncMlxLM  # the upstream venv's

    llm = AsyncMlxLM.from_name(model_dir)
    return run_particles(llm, prompt, own, lambda: llm.next_token_logprobs_sync([1, 2, 3]))


def run_mlx_floor(model_dir, prompt, own) -> dict:
    import mlx.core as mx
    import numpy as np
    import torch
    from mlx_lm.models.cache import KVCache

    from genlm_backend.llm.mlx.compat import load_model

    model = load_model(model_dir)
    mx.eval(model(mx.array([[1, 2, 3]])))  # warm-up

    def logprobs(logits):  # what a caller gets: float32 torch rows
        row = logits.astype(mx.float32)
        row = row - mx.logsumexp(row, axis=-1, keepdims=True)
        mx.eval(row)
        return torch.from_numpy(np.array(row))

    start = time.perf_counter()
    caches = [KVCache() for _ in model.layers]
    logprobs(model(mx.array([prompt]), cache=caches)[:, -1])
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    for cache in caches:  # the prompt copied into every particle's row
        cache.keys = mx.repeat(cache.keys[:, :, : cache.offset], len(own), 0)
        cache.values = mx.repeat(cache.values[:, :, : cache.offset], len(own), 0)
    for step in range(len(own[0])):
        tokens = mx.array([steps[step] for steps in own])
        logprobs(model(tokens, cache=caches)[:, -1])
    return {"prompt_s": prompt_s, "steps_s": time.perf_counter() - start}


RUNNERS = {
    "ours": run_ours,
    "hf": run_hf,
    "upstream": run_upstream,
    "mlx-floor": run_mlx_floor,
}


def run_child(args) -> dict:
    particles, steps, prompt_tokens, uneven = parse_workload(args.workload)
    if args.child == "mlx-floor" and uneven > 1:
        return {"error": "the plain loop steps every row by one token"}
    prompt, own = token_draws(particles, steps, prompt_tokens, uneven)
    result = RUNNERS[args.child](args.model_dir, prompt, own)
    return result | {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def spawn(variant: str, workload: str, model_dir: str, upstream_dir: str) -> dict:
    python = sys.executable
    if variant == "upstream":
        if not UPSTREAM_PYTHON.exists():
            return {"error": f"no {UPSTREAM_PYTHON}; run benchmarks/upstream_mlx_env.sh"}
        python, model_dir = str(UPSTREAM_PYTHON), upstream_dir
    command = [python, __file__, "--child", variant, "--workload", workload]
    command += ["--model-dir", model_dir]
    env = os.environ | {"PYTHONPATH": str(HERE.parent)} if variant != "upstream" else None
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if result.returncode != 0:
        return {"error": result.stderr[-1500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def folder_with_top_level_rope(model_dir: str, into: Path) -> str:
    """A copy of ``model_dir`` (files linked) whose config has mlx-lm's top-level RoPE keys."""
    from genlm_backend.llm.mlx.compat import config_overrides

    for path in Path(model_dir).iterdir():
        if path.name != "config.json":
            (into / path.name).symlink_to(path)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    (into / "config.json").write_text(json.dumps(config | config_overrides(config)))
    return str(into)


def median(runs: list[dict]) -> dict:
    good = sorted((r for r in runs if "steps_s" in r), key=lambda r: r["steps_s"])
    if not good:
        return runs[0]
    return good[len(good) // 2] | {"all_steps_s": [round(r["steps_s"], 2) for r in good]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), help="PxS@T")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, in turns")
    parser.add_argument("--json", type=Path, help="also write all runs to this JSON file")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return
    from genlm_backend.models import default_model_dir

    model_dir = str(default_model_dir())
    print(
        f"# bench_mlx: SmolLM2-135M fp32, MLX CPU build, {platform.machine()}, {os.cpu_count()} CPUs"
    )
    print(f"median of {args.repeats} runs per variant, in turns, each in a fresh process")
    print(
        "| workload | variant | steps s (median) | vs ours | all steps s | prompt s | peak RSS MB | tokens computed / requested |"
    )
    print("|---|---|---|---|---|---|---|---|")
    everything = {}
    with tempfile.TemporaryDirectory() as tmp:
        upstream_dir = folder_with_top_level_rope(model_dir, Path(tmp))
        for workload in args.workloads:
            runs: dict[str, list[dict]] = {v: [] for v in args.variants}
            for _ in range(args.repeats):
                for variant in args.variants:
                    runs[variant].append(spawn(variant, workload, model_dir, upstream_dir))
                    print(f"{workload} {variant}: {runs[variant][-1]}", file=sys.stderr, flush=True)
            results = {v: median(r) for v, r in runs.items()}
            everything[workload] = runs
            ours = results.get("ours", {}).get("steps_s")
            for variant, r in results.items():
                if "error" in r:
                    print(f"| {workload} | {variant} | error: {r['error'][-200:]!r} |")
                    continue
                ratio = f"{r['steps_s'] / ours:.2f}x" if ours else "-"
                tokens = (
                    f"{r['tokens_computed']} / {r['tokens_requested']}"
                    if "tokens_computed" in r
                    else "-"
                )
                print(
                    f"| {workload} | {variant} | {r['steps_s']:.2f} | {ratio} | {r['all_steps_s']} "
                    f"| {r['prompt_s']:.2f} | {r['peak_rss_mb']:.0f} | {tokens} |",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
