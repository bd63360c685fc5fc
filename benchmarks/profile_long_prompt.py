"""Where a step of ours goes behind a long prompt: host milliseconds per step of each phase, next to the floor.

The HF backend's phases are timed by wrapping them (no profiler, so Python
work is not inflated): validation and the batch-cost estimate on the event
loop; the lookups and the plan, the forward pass (and the model call inside it), the
commit into the KV tree and the output cache on the worker thread. Each
round runs the floor (``bench_long_prompt``'s: the N-copies steps behind 64
tokens plus the prompt's attention once) and then ours on fresh particles,
in one process. On a GPU, the time ours waits for the device at the end of
a round is printed too: near zero means the steps are bound by host work.
The event loop's CPU time per request (``time.thread_time`` of the loop's
thread around each step's calls: validation, hashing, the output cache, the
batcher, the row's copy) is the host work a request costs the loop.

Usage::

    python benchmarks/profile_long_prompt.py --workload 64x16@4096
    python benchmarks/profile_long_prompt.py --device cuda --dtype bfloat16 \\
        --random-weights LLAMA3_8B_CONFIG_DIR --workload 64x16@4096
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_long_prompt import (
    load_model,
    ncopies_steps,
    parse_workload,
    prompt_attention_seconds,
    synchronize,
    token_draws,
)


def wrap(owner, name: str, totals: collections.Counter, label: str | None = None) -> None:
    """Replace ``owner.name`` by a version that adds its wall time to ``totals[label]``."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label or name] += time.perf_counter() - start

    setattr(owner, name, timed)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="64x16@4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument("--random-weights", type=Path, help="config folder: random weights")
    args = parser.parse_args(argv)

    import torch

    from genlm_backend.llm.hf import AsyncTransformer
    from genlm_backend.llm.hf import runner as hf_runner

    torch.set_num_threads(args.threads)
    particles, steps, prompt_tokens = parse_workload(args.workload)
    model = load_model(args)
    vocab_size = model.config.get_text_config().vocab_size
    llm = AsyncTransformer(model, None, byte_vocab=[b"<%d>" % i for i in range(vocab_size)])
    totals: collections.Counter = collections.Counter()
    runner = llm.runner
    wrap(runner, "run", totals)
    wrap(runner, "request_tokens", totals)
    for name in ("lookup", "execute"):
        wrap(runner.driver, name, totals)
    for name in ("forward", "_block_with_pasts"):
        wrap(runner.executor, name, totals)
    wrap(hf_runner.planner, "pass_inputs", totals)
    wrap(runner.kv_tree, "commit", totals)
    wrap(runner.model, "forward", totals, "model forward")
    wrap(llm._contexts, "validate", totals, "validation")
    wrap(llm.output_cache, "put_rows", totals, "output cache put")

    prompt, _ = token_draws(vocab_size, particles, steps, prompt_tokens)
    floor_prompt, floor_own = token_draws(vocab_size, particles, steps, 64)

    async def ours(seed: int) -> tuple[float, float, float]:
        _, own = token_draws(vocab_size, particles, steps, prompt_tokens, seed=seed)
        synchronize(args.device)
        totals.clear()
        loop_s = 0.0  # CPU seconds of this thread, the event loop's, inside the steps' calls
        start = time.perf_counter()
        for step in range(steps):
            contexts = [prompt + own[i][: step + 1] for i in range(particles)]
            loop_start = time.thread_time()
            await asyncio.gather(*map(llm.next_token_logprobs, contexts))
            loop_s += time.thread_time() - loop_start
        launched = time.perf_counter()
        synchronize(args.device)
        end = time.perf_counter()
        return end - start, end - launched, loop_s / (steps * particles)

    async def rounds() -> None:
        await llm.next_token_logprobs(prompt)
        await ours(args.rounds + 1)  # warm-up (seeds 1..rounds are the rounds)
        ncopies_steps(model, args, particles, 2, floor_prompt, floor_own)
        for index in range(args.rounds):
            _, floor_s, _ = ncopies_steps(model, args, particles, steps, floor_prompt, floor_own)
            floor_s += prompt_attention_seconds(model, args, particles, steps, prompt_tokens)
            ours_s, waited_s, loop_per_request_s = await ours(index + 1)
            print(
                f"{args.workload} round {index}: floor {floor_s / steps * 1e3:.1f} ms/step, "
                f"ours {ours_s / steps * 1e3:.1f} ms/step ({ours_s / floor_s:.2f}x), "
                f"device wait at the end {waited_s * 1e3:.1f} ms",
                flush=True,
            )
            phases = {k: round(v / steps * 1e3, 1) for k, v in totals.most_common()}
            print(f"    ours's phases, host ms/step: {phases}", flush=True)
            print(
                f"    event loop CPU per request: {loop_per_request_s * 1e6:.1f} us",
                flush=True,
            )

    asyncio.run(rounds())


if __name__ == "__main__":
    main()
