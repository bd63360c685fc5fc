"""The engine's share of a particle step: ours against its runner alone and a plain decode loop.

Workload ``PxS@T``: P particles behind one T-token prompt take S steps; each
particle chooses its next token from its own row (``argmax``), so every step
depends on the last and every row is distinct (each particle's first token
differs). The model is a 2-layer Llama of random weights (width 256, 4 heads
of 64, SmolLM2's 49,152-token vocabulary), small enough that the host work
around the model shows. float32 on the CPU, ``--threads`` torch threads.
Each variant runs in a fresh process, variants in turns, ``--repeats`` times:

* ``loop``: a plain batched decode loop (transformers ``DynamicCache``, the
  prompt's keys/values copied into every row, one forward pass of P tokens
  per step, one batched ``argmax``): the model alone.
* ``ours-runner``: ``HFRunner.run`` called with the step's requests, one
  batched ``argmax``: the runner's own work (planning, the KV tree, the
  forward pass) without the engine.
* ``ours``: ``await llm.next_token_logprobs(context)`` for each particle, on
  ``AsyncTransformer``'s defaults; each particle takes ``argmax`` of its row.

The prompt's prefill and two warm-up steps are not timed; the figure is the
mean step time. Ratios: ours over loop (behind the shortest prompt, where
the loop's copies of the prompt cost nothing), ours over ours-runner (the
engine's share), and each variant's step behind each prompt over its step
behind the first.

    python benchmarks/bench_engine.py                              # 64x32@64 and 64x32@4096
    python benchmarks/bench_engine.py --workloads 64x32@64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_long_prompt import parse_workload, token_draws

VARIANTS = ("loop", "ours-runner", "ours")
WORKLOADS = ("64x32@64", "64x32@4096")
NUM_WARM_UP_STEPS = 2


def small_llama():
    """The 2-layer random-weight Llama (seeded: every process builds the same weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def run_variant(variant: str, workload: str, threads: int) -> dict:
    """One variant in this process: seconds per timed step."""
    import torch

    torch.set_num_threads(threads)
    particles, steps, prompt_tokens = parse_workload(workload)
    model = small_llama()
    prompt, own = token_draws(model.config.vocab_size, particles, 1, prompt_tokens)
    firsts = [o[0] for o in own]
    total = NUM_WARM_UP_STEPS + steps
    if variant == "loop":
        step_s = _loop(model, prompt, firsts, total)
    elif variant == "ours-runner":
        step_s = _runner(model, prompt, firsts, total)
    elif variant == "ours":
        step_s = _ours(model, prompt, firsts, total)
    else:
        raise ValueError(variant)
    return {"variant": variant, "workload": workload, "step_s": step_s}


def _mean_timed(times: list[float]) -> float:
    return statistics.fmean(times[NUM_WARM_UP_STEPS:])


def _loop(model, prompt, firsts, total) -> float:
    import torch
    from transformers import DynamicCache

    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(len(firsts))  # the prompt copied into every row
        tokens = torch.tensor(firsts)[:, None]
        for _ in range(total):
            start = time.perf_counter()
            logits = model(tokens, past_key_values=cache, use_cache=True).logits[:, -1]
            tokens = torch.log_softmax(logits.float(), -1).argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return _mean_timed(times)


def _runner(model, prompt, firsts, total) -> float:
    from genlm_backend.llm.hf import AsyncTransformer
    from genlm_backend.llm.runner import Request

    llm = AsyncTransformer(model, None, byte_vocab=[b"<%d>" % i for i in range(49152)])
    runner = llm.runner
    runner.run([Request(None, tuple(prompt))])
    contexts = [(*prompt, first) for first in firsts]
    times = []
    for _ in range(total):
        start = time.perf_counter()
        rows = runner.run([Request(None, context) for context in contexts])
        chosen = rows.argmax(-1).tolist()
        contexts = [(*context, token) for context, token in zip(contexts, chosen)]
        times.append(time.perf_counter() - start)
    llm.close()
    return _mean_timed(times)


def _ours(model, prompt, firsts, total) -> float:
    import asyncio

    from genlm_backend.llm.hf import AsyncTransformer

    llm = AsyncTransformer(model, None, byte_vocab=[b"<%d>" % i for i in range(49152)])
    llm.next_token_logprobs_sync(prompt)
    step_ends: list[float] = []

    async def particle(first: int) -> None:
        context = [*prompt, first]
        for step in range(total):
            row = await llm.next_token_logprobs(context)
            context.append(int(row.argmax()))
            if len(step_ends) <= step:
                step_ends.append(0.0)
            step_ends[step] = time.perf_counter()  # the last particle's end ends the step

    async def main() -> float:
        start = time.perf_counter()
        await asyncio.gather(*map(particle, firsts))
        starts = [start, *step_ends[:-1]]
        return _mean_timed([end - begin for begin, end in zip(starts, step_ends)])

    step_s = asyncio.run(main())
    llm.close()
    return step_s


def spawn(variant: str, workload: str, threads: int) -> dict:
    argv = [sys.executable, __file__, "--child", variant, "--workload", workload]
    argv += ["--threads", str(threads)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, in turns")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write all results to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_variant(args.child, args.workload, args.threads)))
        return
    results = []
    for repeat in range(args.repeats):
        for workload in args.workloads:
            for variant in args.variants:
                result = spawn(variant, workload, args.threads)
                results.append(result)
                print(f"run {repeat + 1}: {workload} {variant}: {1e3 * result['step_s']:.2f} ms")
    report(results, args.workloads, args.variants)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def report(results: list[dict], workloads: list[str], variants: list[str]) -> None:
    def median_ms(workload: str, variant: str) -> float:
        runs = [r["step_s"] for r in results if (r["workload"], r["variant"]) == (workload, variant)]
        return 1e3 * statistics.median(runs)

    def all_runs(workload: str, variant: str) -> str:
        runs = [r["step_s"] for r in results if (r["workload"], r["variant"]) == (workload, variant)]
        return ", ".join(f"{1e3 * run:.1f}" for run in runs)

    first = workloads[0]
    print("\nmedian step (ms) of each variant's runs; ratios of medians")
    print("| workload | variant | step (ms) | vs loop | vs ours-runner | vs its step at " + first + " | all runs (ms) |")
    print("|---|---|---|---|---|---|---|")
    for workload in workloads:
        for variant in variants:
            ms = median_ms(workload, variant)
            vs_loop = f"{ms / median_ms(workload, 'loop'):.2f}x" if "loop" in variants else "-"
            vs_runner = (
                f"{ms / median_ms(workload, 'ours-runner'):.2f}x"
                if "ours-runner" in variants
                else "-"
            )
            vs_first = f"{ms / median_ms(first, variant):.2f}x"
            print(
                f"| {workload} | {variant} | {ms:.2f} | {vs_loop} | {vs_runner} | {vs_first} "
                f"| {all_runs(workload, variant)} |"
            )


if __name__ == "__main__":
    main()
