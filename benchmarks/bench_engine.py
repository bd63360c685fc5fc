"""The engine's share of a particle step: ours against its runner alone and a plain decode loop.

Workload ``PxS@T``: P particles behind one T-token prompt take S steps; each
particle chooses its next token from its own row (``--draw numpy``: numpy's
``argmax``; ``--draw torch``: ``int(row[:V].argmax())``, a torch operation per
row), so every step depends on the last and every row is distinct (each
particle's first token differs). The model is a 2-layer Llama of random weights (width 256, 4 heads
of 64, SmolLM2's 49,152-token vocabulary), small enough that the host work
around the model shows. float32 on the CPU, ``--threads`` torch threads.
The variants run in turns in one process (the machine's speed drifts between
processes and minutes: ratios within a round are what to trust), ``--rounds`` rounds:

* ``loop``: a plain batched decode loop (transformers ``DynamicCache``, the
  prompt's keys/values copied into every row, one forward pass of P tokens
  per step, one batched ``argmax``): the model alone.
* ``loop-rows``: the same loop, each row drawn on its own as a particle
  draws it (``--draw``), one after another: the loop with the particles'
  draw, whose cost per row a batched ``argmax`` hides (a torch ``argmax``
  over one row runs in one thread; the batched one splits the rows over the
  threads).
* ``ours-runner``: ``HFRunner.run`` called with the step's requests, one
  batched ``argmax``: the runner's own work (planning, the KV tree, the
  forward pass) without the engine.
* ``ours``: ``await llm.next_token_logprobs(context)`` for each particle, on
  ``AsyncTransformer``'s defaults; each particle draws from its own row.

``ours-runner`` also reports its model time: the model's forward and the rows'
log-softmax, timed inside the step (and the step's greedy draw, timed apart:
not the runner's); the rest of the runner's step (lookup, plan, inputs,
commit) is its host work. Its step is ``HFRunner.run`` and the draw: the
requests are made before it (making them, and freeing the last step's, is
the front's work, which ours pays). Each round reports the microseconds
a request costs in ours beyond ours-runner (the front and the engine), and the
runner's host work per step. ``ours`` also prints its minor page faults a
step (memory the process maps anew, as a growing output cache makes it) and
what its output cache holds.
* ``floor``: what an exact step cannot skip behind a T-token prompt: the
  loop's step behind the shortest prompt of the run, plus the prompt's
  attention computed once per layer for every row together (grouped queries
  against one copy: ``bench_long_prompt.prompt_attention_seconds``). Behind
  the shortest prompt it is that loop step plus its own prompt's attention.

The prompt's prefill and two warm-up steps are not timed; the figure is the
mean step time. Ratios, each the median over rounds of that round's ratio:
ours over loop (behind the shortest prompt, where the loop's copies of the
prompt cost nothing), ours over ours-runner (the engine's share), and each
variant's step behind each prompt over its step behind the first.

    python benchmarks/bench_engine.py                              # 64x32@64 and 64x32@4096
    python benchmarks/bench_engine.py --workloads 64x32@64 --rounds 7 --draw torch
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_long_prompt import (  # noqa: E402
    parse_workload,
    prompt_attention_seconds,
    token_draws,
)

VARIANTS = ("loop", "loop-rows", "ours-runner", "ours")
DRAWS = ("numpy", "torch")
"""Run one by one; the floor is computed from the loop's step and the prompt's attention."""
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


def run_variant(model, variant: str, workload: str, draw: str = "numpy") -> float | tuple:
    """One variant's mean step time, in seconds, in this process (``ours-runner``: and its model's)."""
    particles, steps, prompt_tokens = parse_workload(workload)
    if variant == "attention":
        total_s = prompt_attention_seconds(
            model, argparse.Namespace(device="cpu"), particles, steps, prompt_tokens
        )
        return total_s / steps
    prompt, own = token_draws(model.config.vocab_size, particles, 1, prompt_tokens)
    firsts = [o[0] for o in own]
    if variant == "ours":
        return _ours(model, prompt, firsts, NUM_WARM_UP_STEPS + steps, draw)
    if variant == "loop-rows":
        return _loop(model, prompt, firsts, NUM_WARM_UP_STEPS + steps, draw)
    run = {"loop": _loop, "ours-runner": _runner}[variant]
    return run(model, prompt, firsts, NUM_WARM_UP_STEPS + steps)


def _mean_timed(times: list[float]) -> float:
    return statistics.fmean(times[NUM_WARM_UP_STEPS:])


def _loop(model, prompt, firsts, total, draw: str | None = None) -> float:
    """The plain loop's mean step; with ``draw``, each row drawn on its own as a particle does."""
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
            rows = torch.log_softmax(logits.float(), -1)
            if draw is None:
                tokens = rows.argmax(-1, keepdim=True)
            else:
                vocab = model.config.vocab_size
                tokens = torch.tensor([[_draw(row, draw, vocab)] for row in rows])
            times.append(time.perf_counter() - start)
    return _mean_timed(times)


def _runner(model, prompt, firsts, total) -> tuple[float, float]:
    from genlm_backend.cache.kv_tree import untracked
    from genlm_backend.llm import runner as runner_module
    from genlm_backend.llm.hf import AsyncTransformer
    from genlm_backend.llm.hf import runner as hf_runner
    from genlm_backend.llm.runner import Request

    llm = AsyncTransformer(model, None, byte_vocab=[b"<%d>" % i for i in range(49152)])
    runner = llm.runner
    runner.run([Request(None, tuple(prompt))])
    contexts = [untracked((*prompt, first)) for first in firsts]
    parents: list = [None] * len(contexts)  # each request's context one token shorter, as the
    # front passes it (the KV tree then finds its node by the tuple's identity)
    model_s = [0.0]
    forward, fit = model.forward, runner_module.fit_to_vocab

    def timed(function):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                model_s[0] += time.perf_counter() - start

        return call

    model.forward = timed(forward)
    hf_runner.fit_to_vocab = timed(fit)
    times, model_times = [], []
    try:
        for _ in range(total):
            model_s[0] = 0.0
            # The front's work, not the runner's: ours pays it in ours - ours-runner.
            requests = [Request(None, c, p) for c, p in zip(contexts, parents)]
            start = time.perf_counter()
            rows = runner.run(requests)
            drawn = time.perf_counter()
            chosen = rows.argmax(-1).tolist()
            parents = contexts
            # Untracked by the garbage collector, as the front leaves a validated context.
            contexts = [untracked((*context, token)) for context, token in zip(contexts, chosen)]
            end = time.perf_counter()
            times.append(end - start)
            model_times.append(model_s[0] + end - drawn)  # the draw is not the runner's work
    finally:
        del model.forward
        hf_runner.fit_to_vocab = fit
    llm.close()
    return _mean_timed(times), _mean_timed(model_times)


def _draw(row, draw: str, vocab: int | None = None) -> int:
    """A particle's next token from its row: ``int(row[:vocab].argmax())`` (torch) or numpy's."""
    if draw == "torch":
        return int(row[:vocab].argmax())
    return int(row.numpy().argmax())


def _ours(model, prompt, firsts, total, draw: str) -> float:
    """Ours' mean step; prints the minor page faults a step (memory the process maps anew:
    what a step's output costs while the output cache grows) and what the cache holds."""
    import asyncio
    import resource

    from genlm_backend.llm.hf import AsyncTransformer

    llm = AsyncTransformer(model, None, byte_vocab=[b"<%d>" % i for i in range(49152)])
    llm.next_token_logprobs_sync(prompt)
    step_ends: list[float] = []

    async def particle(first: int) -> None:
        context = [*prompt, first]
        vocab = llm.vocab_size
        for step in range(total):
            row = await llm.next_token_logprobs(context)
            context.append(_draw(row, draw, vocab))
            if len(step_ends) <= step:
                step_ends.append(0.0)
            step_ends[step] = time.perf_counter()  # the last particle's end ends the step

    async def main() -> float:
        start = time.perf_counter()
        await asyncio.gather(*map(particle, firsts))
        starts = [start, *step_ends[:-1]]
        return _mean_timed([end - begin for begin, end in zip(starts, step_ends)])

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step_s = asyncio.run(main())
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    held = llm.output_cache.stats
    limit = getattr(held, "limit_bytes", held.budget_bytes)  # a cache of the whole budget
    print(
        f"  ours: {faults / total:,.0f} minor page faults a step; output cache "
        f"{held.bytes_held / 2**20:.0f} MiB held, limit {limit / 2**20:.0f} MiB"
    )
    llm.close()
    return step_s


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every variant in turns")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--draw", choices=DRAWS, default="numpy", help="how a particle reads its row"
    )
    parser.add_argument("--json", type=Path, help="also write all results to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = small_llama()
    results = []
    measured = [*args.variants, "attention"] if "loop" in args.variants else args.variants
    for round_index in range(args.rounds):
        for workload in args.workloads:
            for variant in measured:
                step_s = run_variant(model, variant, workload, args.draw)
                model_s = None
                if isinstance(step_s, tuple):
                    step_s, model_s = step_s
                results.append(
                    {
                        "round": round_index,
                        "workload": workload,
                        "variant": variant,
                        "step_s": step_s,
                        "model_s": model_s,
                    }
                )
                print(
                    f"round {round_index + 1}: {workload} {variant}: {1e3 * step_s:.2f} ms"
                    + ("" if model_s is None else f" (model {1e3 * model_s:.2f} ms)")
                )
    variants = list(args.variants)
    if "loop" in variants:
        results += floors(results, args.workloads)
        variants.append("floor")
    report(results, args.workloads, variants)
    host_report(results, args.workloads)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def floors(results: list[dict], workloads: list[str]) -> list[dict]:
    """Each round's floor per workload: the loop's step behind the first workload's prompt,
    plus the workload's prompt attention (both measured in that round)."""
    step = {(r["round"], r["workload"], r["variant"]): r["step_s"] for r in results}
    return [
        {
            "round": k,
            "workload": workload,
            "variant": "floor",
            "step_s": step[k, workloads[0], "loop"]
            - step[k, workloads[0], "attention"]
            + step[k, workload, "attention"],
        }
        for k in sorted({r["round"] for r in results})
        for workload in workloads
    ]


def report(results: list[dict], workloads: list[str], variants: list[str]) -> None:
    step = {(r["round"], r["workload"], r["variant"]): r["step_s"] for r in results}
    rounds = sorted({r["round"] for r in results})

    def median_ratio(workload, variant, other_workload, other_variant) -> str:
        if other_variant not in variants:
            return "-"
        ratios = [
            step[k, workload, variant] / step[k, other_workload, other_variant] for k in rounds
        ]
        return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

    first = workloads[0]
    print(f"\n{len(rounds)} rounds; each ratio is the median of the rounds' ratios (their range)")
    print(
        "| workload | variant | step (ms, median) | vs floor | vs loop | vs loop-rows "
        f"| vs ours-runner | vs its step at {first} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for workload in workloads:
        for variant in variants:
            ms = 1e3 * statistics.median(step[k, workload, variant] for k in rounds)
            print(
                f"| {workload} | {variant} | {ms:.2f} "
                f"| {median_ratio(workload, variant, workload, 'floor')} "
                f"| {median_ratio(workload, variant, workload, 'loop')} "
                f"| {median_ratio(workload, variant, workload, 'loop-rows')} "
                f"| {median_ratio(workload, variant, workload, 'ours-runner')} "
                f"| {median_ratio(workload, variant, first, variant)} |"
            )


def host_report(results: list[dict], workloads: list[str]) -> None:
    """Per workload, medians over rounds: the microseconds a request costs in ours beyond
    ours-runner, and ours-runner's host work per step (its step minus its model time)."""
    by = {(r["round"], r["workload"], r["variant"]): r for r in results}
    rounds = sorted({r["round"] for r in results})
    print("\n| workload | ours - ours-runner (us a request) | runner host work (ms a step) |")
    print("|---|---|---|")
    for workload in workloads:
        particles = parse_workload(workload)[0]
        extra, host = [], []
        for k in rounds:
            ours, runner = by.get((k, workload, "ours")), by.get((k, workload, "ours-runner"))
            if runner is not None and runner["model_s"] is not None:
                host.append(1e3 * (runner["step_s"] - runner["model_s"]))
            if ours is not None and runner is not None:
                extra.append(1e6 * (ours["step_s"] - runner["step_s"]) / particles)
        print(f"| {workload} | {_median_range(extra, '.1f')} | {_median_range(host, '.2f')} |")


def _median_range(values: list[float], spec: str) -> str:
    """``median (min-max)`` of ``values``, ``-`` if none."""
    if not values:
        return "-"
    low, mid, high = (
        format(v, spec) for v in (min(values), statistics.median(values), max(values))
    )
    return f"{mid} ({low}-{high})"


if __name__ == "__main__":
    main()
