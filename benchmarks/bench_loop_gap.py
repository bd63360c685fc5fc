"""How long the event loop stops while a first batch prefills: a ticker's largest gap.

Workload: 16 particles whose contexts share a 190-token prefix (SmolLM2's
tokens of a seeded random draw, each particle adding two tokens of its own),
awaited together on a fresh model, while a ticker coroutine on the same loop
sleeps 5 ms at a time and records when it wakes. Reported per setup (in turns,
``--rounds`` rounds, medians): the batch's time, the ticker's largest gap, and
the gap over the batch time.

* ``whole``: steps in the loop's thread, uncut (``chunk_tokens=None``);
* ``chunks N``: steps in the loop's thread, ``chunk_tokens=N``;
* ``worker``: steps in a worker thread (``compute_in_loop=False``).

    python benchmarks/bench_loop_gap.py [--chunks 32 64 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TICK_S = 0.005


def contexts_of(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(190)]
    return [[*prefix, rng.randrange(vocab_size), rng.randrange(vocab_size)] for _ in range(16)]


async def one_batch(llm, contexts) -> tuple[float, float]:
    """The batch's seconds and the ticker's largest gap meanwhile."""
    wakes: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            wakes.append(time.perf_counter())
            await asyncio.sleep(TICK_S)

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)  # the ticker's first wake
    start = time.perf_counter()
    await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    end = time.perf_counter()
    done.set()
    await tick
    wakes.append(end)
    gaps = [b - a for a, b in itertools.pairwise(wakes) if b > start]
    return end - start, max(gaps)


def setups(chunk_sizes: list[int]) -> dict[str, dict]:
    found = {"whole": {"chunk_tokens": None}}
    found.update({f"chunks {n}": {"chunk_tokens": n} for n in chunk_sizes})
    found["worker"] = {"compute_in_loop": False}
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from genlm_backend.llm.hf import AsyncTransformer
    from genlm_backend.models import default_model_dir

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir()).eval()
    vocab = [b"<%d>" % i for i in range(model.config.vocab_size)]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in setups(args.chunks)}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for name, options in setups(args.chunks).items():
            llm = AsyncTransformer(model, None, byte_vocab=vocab, **options)
            measured = asyncio.run(one_batch(llm, contexts_of(len(vocab), round_index)))
            llm.close()
            if round_index:
                results[name].append(measured)
                print(
                    f"round {round_index}: {name}: batch {measured[0] * 1e3:.0f} ms, "
                    f"largest gap {measured[1] * 1e3:.0f} ms",
                    flush=True,
                )
    print("\n| setup | batch (ms) | largest ticker gap (ms) | gap / batch |")
    print("|---|---|---|---|")
    for name, measured in results.items():
        batch = statistics.median(b for b, _ in measured)
        gap = statistics.median(g for _, g in measured)
        ratio = statistics.median(g / b for b, g in measured)
        print(f"| {name} | {batch * 1e3:.0f} | {gap * 1e3:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
