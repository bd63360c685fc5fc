"""Particles caught in one repetition loop: their step against particles that write distinct tokens.

Small models loop ("the the the", blank lines): particles behind one long
prompt then end alike, in length and in every recent token, and differ only
after the prompt. Every dictionary keyed by their contexts (the batcher's,
the output cache's, the recent contexts the front checks a particle's
context against, the KV tree's) must tell them apart without comparing
every pair's tokens, each comparison reading the prompt.

Workload ``PxS@T``: P particles behind one T-token prompt, each with its own
first token, then S steps through ``await llm.next_token_logprobs``: with
``repeat`` every particle appends the same token at every step; with
``distinct`` each appends a token of its own seeded stream. The model is
``bench_engine``'s 2-layer Llama of random weights (whose step does not
depend on the tokens' values); the same process runs both streams in turns,
``--rounds`` rounds, each on a fresh ``AsyncTransformer``. The figure is the
mean step time over the steps after the first ``HASHED_TAIL + 2`` (from then
on every repeating particle's last ``HASHED_TAIL`` tokens are the loop's),
and the ratio repeat / distinct, the median over rounds.

    python benchmarks/bench_repetition.py                       # 64x48@4096, 3 rounds
    python benchmarks/bench_repetition.py --workloads 64x48@1024 64x48@4096 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_engine import small_llama  # noqa: E402
from bench_long_prompt import parse_workload, token_draws  # noqa: E402

STREAMS = ("distinct", "repeat")
LOOP_TOKEN = 5


def run_stream(model, workload: str, stream: str, seed: int) -> float:
    """Mean step seconds of ``stream`` over the steps whose tails are the loop's."""
    from genlm_backend.cache.kv_tree import HASHED_TAIL
    from genlm_backend.llm.hf import AsyncTransformer

    particles, steps, prompt_tokens = parse_workload(workload)
    prompt, own = token_draws(model.config.vocab_size, particles, 1, prompt_tokens)
    llm = AsyncTransformer(model, None, byte_vocab=[b"<%d>" % i for i in range(49152)])
    llm.next_token_logprobs_sync(prompt)
    step_ends = [0.0] * steps

    async def particle(index: int, first: int) -> None:
        rng = random.Random(seed * 1000 + index)
        context = [*prompt, first]
        for step in range(steps):
            await llm.next_token_logprobs(context)
            context.append(LOOP_TOKEN if stream == "repeat" else rng.randrange(6, 32000))
            step_ends[step] = time.perf_counter()  # the last particle's end ends the step

    async def main() -> None:
        await asyncio.gather(*(particle(i, o[0]) for i, o in enumerate(own)))

    asyncio.run(main())
    llm.close()
    first = HASHED_TAIL + 2
    if steps <= first + 1:
        raise SystemExit(f"{workload}: take more than {first + 1} steps")
    return (step_ends[-1] - step_ends[first]) / (steps - 1 - first)


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["64x48@4096"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = small_llama()
    for workload in args.workloads:
        times: dict[str, list[float]] = {stream: [] for stream in STREAMS}
        for round_index in range(args.rounds):
            for stream in STREAMS:
                step_s = run_stream(model, workload, stream, round_index)
                times[stream].append(step_s)
                print(f"round {round_index + 1}: {workload} {stream}: {1e3 * step_s:.2f} ms a step")
        ratios = [r / d for r, d in zip(times["repeat"], times["distinct"])]
        print(
            f"| {workload} | distinct {1e3 * statistics.median(times['distinct']):.2f} ms "
            f"| repeat {1e3 * statistics.median(times['repeat']):.2f} ms "
            f"| repeat / distinct {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
