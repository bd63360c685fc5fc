"""SMC-style sampling throughput of the HF backend vs the floor vs upstream genlm-backend.

Workload: N particles each sample S tokens, one ``await next_token_logprobs``
per step, from a shared 25-token prompt, SmolLM2-135M-Instruct fp32 on CPU
(2 threads). Every variant samples by inverting the CDF
(``genlm_backend.llm.base.sample_token``; the floor does it batched). Each
variant runs in its own process (clean peak RSS):

* ``floor``: a plain batched decode loop with a transformers DynamicCache
  (one forward of N tokens per step): the cost of the model alone.
* ``ours``: ``genlm_backend.AsyncTransformer`` with default settings (no
  ``batch_size``: each batch takes every waiting context within the token
  budget), or with ``--batch-size``.
* ``ours+worker``: ``ours`` with ``compute_in_loop=False`` (steps in a worker
  thread, as a server runs them; the default runs them in the event loop's thread).
* ``ours+fused``: ``ours`` with ``executor="fused"`` (the fused Llama-family
  decoder, compiled on its first pass: the compile is inside the timed run).
* ``ours+fused-warm``: the same, compiled before the timed run (one batch of two
  contexts, then the caches cleared): the fused step's own speed, and the
  compile's seconds apart (``compile_s``; its token counts include that batch's).
* ``baseline``: ``ours`` as another checkout of this repository runs it
  (``--baseline-tree``, e.g. the main branch), to compare two versions.
* ``upstream``, ``upstream+cache_kv``: genlm-backend 0.3.1's ``AsyncTransformer``
  from its own virtualenv (``benchmarks/upstream_env.sh``), without and with
  ``cache_kv`` on the prompt.

Usage::

    python benchmarks/bench_hf.py                      # 16x32 and 64x128
    python benchmarks/bench_hf.py --workloads 16x32 --variants floor ours
    python benchmarks/bench_hf.py --workloads 1x32 --variants floor baseline ours --baseline-tree ../main
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
UPSTREAM_PYTHON = Path(os.environ.get("UPSTREAM_VENV", "/work/venvs/upstream")) / "bin" / "python"
PROMPT = "Write a short story about a fox who learns to read. Once upon a time, in a quiet forest,"
VARIANTS = ("floor", "ours", "upstream", "upstream+cache_kv")
OPTIONAL_VARIANTS = ("baseline", "ours+worker", "ours+fused", "ours+fused-warm")
OURS_VARIANTS = ("ours", "ours+worker", "ours+fused", "ours+fused-warm")


def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(PROMPT)
    return ids[:25]


def run_variant(
    variant: str, particles: int, steps: int, model_dir: str, batch_size: int | None = None
) -> dict:
    """Run one variant in this process; returns seconds and peak RSS."""
    import torch

    torch.set_num_threads(2)
    if variant == "floor":
        seconds = _run_floor(particles, steps, model_dir)
    elif variant in OURS_VARIANTS:
        in_loop = variant != "ours+worker"
        executor = "fused" if variant.startswith("ours+fused") else None
        precompile = variant == "ours+fused-warm"
        seconds, stats = _run_ours(
            particles, steps, model_dir, batch_size, in_loop, executor, precompile
        )
    else:
        raise ValueError(variant)
    result = {"variant": variant, "seconds": seconds, "peak_rss_mb": _peak_rss_mb()}
    if variant in OURS_VARIANTS:
        result["stats"] = stats
    return result


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _run_floor(particles: int, steps: int, model_dir: str) -> float:
    import torch
    from transformers import DynamicCache

    model, tokenizer = _load(model_dir)
    prompt = prompt_ids(tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.tensor([prompt]))  # warm-up
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        logits = model(
            torch.tensor([prompt] * particles), past_key_values=cache, use_cache=True
        ).logits[:, -1]
        for _ in range(steps):
            # the batched form of genlm_backend.llm.base.sample_token (inverse CDF)
            cdf = torch.softmax(torch.log_softmax(logits.float(), -1).double(), -1).cumsum_(-1)
            u = torch.rand(particles, 1, dtype=torch.float64, generator=generator) * cdf[:, -1:]
            tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
            logits = model(tokens, past_key_values=cache, use_cache=True).logits[:, -1]
        return time.perf_counter() - start


def _run_ours(
    particles: int,
    steps: int,
    model_dir: str,
    batch_size: int | None,
    in_loop: bool = True,
    executor: str | None = None,
    precompile: bool = False,
):
    import asyncio
    import dataclasses

    import torch

    from genlm_backend.llm.base import sample_token
    from genlm_backend.llm.hf import AsyncTransformer

    model, tokenizer = _load(model_dir)
    options: dict = {"batch_size": batch_size} if batch_size else {}
    if executor is not None:  # compiled on its first pass, inside the timed run
        options["executor"] = executor
    llm = AsyncTransformer(model, tokenizer, compute_in_loop=in_loop, **options)
    prompt = prompt_ids(tokenizer)
    llm.next_token_logprobs_uncached(prompt)  # warm-up, caches nothing
    compile_s = None
    if precompile:  # one pass of new tokens compiles every function later passes run
        began = time.perf_counter()
        llm.batch_next_token_logprobs_sync([[*prompt, 0], [*prompt, 1]])
        compile_s = time.perf_counter() - began
        llm.clear_cache()

    async def particle(seed: int):
        generator = torch.Generator().manual_seed(seed)
        context = list(prompt)
        for _ in range(steps):
            logprobs = await llm.next_token_logprobs(context)
            context.append(sample_token(logprobs, generator))

    async def main():
        await asyncio.gather(*(particle(seed) for seed in range(particles)))

    start = time.perf_counter()
    asyncio.run(main())
    seconds = time.perf_counter() - start
    stats = dataclasses.asdict(llm.stats) | {"mean_batch_size": llm.stats.mean_batch_size}
    if compile_s is not None:
        stats["compile_s"] = compile_s
    return seconds, stats


def spawn(
    variant: str,
    particles: int,
    steps: int,
    model_dir: str,
    batch_size: int | None = None,
    baseline_tree: Path | None = None,
) -> dict:
    tree = HERE.parent
    if variant == "baseline":
        if baseline_tree is None:
            return {"variant": variant, "error": "the baseline variant needs --baseline-tree"}
        tree = baseline_tree.resolve()
        command = [sys.executable, str(tree / "benchmarks" / "bench_hf.py"), "--child", "ours"]
        if batch_size:
            command += ["--batch-size", str(batch_size)]
    elif variant.startswith("upstream"):
        if not UPSTREAM_PYTHON.exists():
            return {
                "variant": variant,
                "error": f"no upstream venv at {UPSTREAM_PYTHON}; run benchmarks/upstream_env.sh",
            }
        command = [
            str(UPSTREAM_PYTHON),
            str(HERE / "upstream_hf_driver.py"),
            "--cache-kv" if "cache_kv" in variant else "--no-cache-kv",
        ]
    else:
        command = [sys.executable, __file__, "--child", variant]
        if batch_size:
            command += ["--batch-size", str(batch_size)]
    command += ["--particles", str(particles), "--steps", str(steps), "--model-dir", model_dir]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        cwd=tree,
        env=os.environ | {"PYTHONPATH": str(tree)},
    )
    if result.returncode != 0:
        return {"variant": variant, "error": result.stderr[-1500:]}
    return json.loads(result.stdout.strip().splitlines()[-1]) | {"variant": variant}


def _interleaved(
    repeats: int,
    variants,
    particles: int,
    steps: int,
    model_dir: str,
    batch_size=None,
    baseline_tree=None,
) -> list[dict]:
    """Run every variant ``repeats`` times, interleaved (each run a fresh process); keep each variant's median run."""
    runs = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            runs[v].append(spawn(v, particles, steps, model_dir, batch_size, baseline_tree))
            # Each run as it ends, on stderr: a long benchmark cut short still leaves its raw numbers.
            print(
                f"{particles}x{steps} {v}: {runs[v][-1].get('seconds', 'error')}",
                file=sys.stderr,
                flush=True,
            )
    results = []
    for variant_runs in runs.values():
        good = sorted((r for r in variant_runs if "seconds" in r), key=lambda r: r["seconds"])
        if not good:
            results.append(variant_runs[0])
            continue
        median = good[len(good) // 2] | {"all_seconds": [round(r["seconds"], 3) for r in good]}
        median["peak_rss_mb"] = max(r["peak_rss_mb"] for r in good)
        results.append(median)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads", nargs="+", default=["16x32", "64x128"], help="PARTICLESxSTEPS"
    )
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=(*VARIANTS, *OPTIONAL_VARIANTS)
    )
    parser.add_argument(
        "--baseline-tree", type=Path, help="checkout whose 'ours' the baseline variant runs"
    )
    parser.add_argument("--child", choices=("floor", *OURS_VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--particles", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="AsyncTransformer batch_size for 'ours' (default: none, the library's count-free policy)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per variant, interleaved; the median is reported",
    )
    parser.add_argument("--json", type=Path, help="also write all results to this JSON file")
    args = parser.parse_args(argv)
    if args.child:
        print(
            json.dumps(
                run_variant(args.child, args.particles, args.steps, args.model_dir, args.batch_size)
            )
        )
        return

    from genlm_backend.models import default_model_dir

    model_dir = str(default_model_dir())
    results = []
    print(f"# bench_hf: SmolLM2-135M fp32, 2 threads, {platform.processor() or platform.machine()}")
    print(
        f"median of {args.repeats} runs per variant, each in a fresh process; "
        f"ours with {f'batch_size={args.batch_size}' if args.batch_size else 'default settings (no batch_size)'}"
    )
    print(
        "| particles x steps | variant | seconds (median) | vs floor | all runs (s) | peak RSS (MB) | mean batch | tokens computed / requested |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        particles, steps = map(int, workload.split("x"))
        rows = [
            r | {"workload": workload}
            for r in _interleaved(
                args.repeats,
                args.variants,
                particles,
                steps,
                model_dir,
                args.batch_size,
                args.baseline_tree,
            )
        ]
        floor = next(
            (r["seconds"] for r in rows if r["variant"] == "floor" and "seconds" in r), None
        )
        for r in rows:
            results.append(r)
            if "error" in r:
                print(
                    f"| {workload} | {r['variant']} | error: {r['error'].strip().splitlines()[-1][:80]} | | | | | |"
                )
                continue
            ratio = f"{r['seconds'] / floor:.2f}x" if floor else "-"
            stats = r.get("stats")
            batch = f"{stats['mean_batch_size']:.1f}" if stats else "-"
            tokens = (
                f"{stats['num_tokens_computed']} / {stats['num_tokens_requested']}"
                if stats
                else "-"
            )
            runs = ", ".join(f"{x:.2f}" for x in r.get("all_seconds", [r["seconds"]]))
            print(
                f"| {workload} | {r['variant']} | {r['seconds']:.2f} | {ratio} | {runs} | {r['peak_rss_mb']:.0f} | {batch} | {tokens} |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
