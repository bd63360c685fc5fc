"""What a batch call costs on top of its runner: validation, then the engine's queue and step.

A ``MockAsyncLM`` whose runner returns a preallocated ``[B, V]`` block at
once (no model, no server), its output cache off, so a
``batch_next_token_logprobs`` of B contexts is all bookkeeping: validating
the contexts, queuing the call, the event loop's passes before the step, the
hand-over to the worker thread (or not: steps in the loop's thread are the
default), settling the call, and the check that the rows are one block. "validation + runner" validates the same contexts and calls the
runner directly, the floor under any batching. One thread; in turns,
median of ``--repeats``.

This is the client's share of a served round trip (``bench_serve.py``'s
"its runner alone" column is the same call without it).

Usage::

    python benchmarks/bench_batch_call.py
    python benchmarks/bench_batch_call.py --rows 16 64 256 --vocab 128256
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from genlm_backend.llm import MockAsyncLM


def make_lm(vocab_size: int, rows: int, compute_in_loop: bool) -> MockAsyncLM:
    lm = MockAsyncLM(byte_vocab=[b"<%d>" % i for i in range(vocab_size)], output_cache_bytes=0)
    block = torch.zeros(rows, vocab_size)
    lm.runner.run = lambda requests: block[: len(requests)]  # at once: no model work
    lm.engine.compute_in_loop = compute_in_loop
    return lm


async def measure(rows: int, vocab_size: int, repeats: int) -> dict[str, float]:
    """ms per call of each setup, in turns (warm-up excluded)."""
    contexts = [list(range(1000, 1025)) + [token] for token in range(rows)]
    worker, in_loop = make_lm(vocab_size, rows, False), make_lm(vocab_size, rows, True)

    async def floor():
        worker.runner.run(worker.requests(contexts, None, "token_ids_list"))

    calls = {
        "batch call, worker thread": lambda: worker.batch_next_token_logprobs(contexts),
        "batch call, in the loop": lambda: in_loop.batch_next_token_logprobs(contexts),
        "validation + runner": floor,
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(20 + repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            await call()
            if repeat >= 20:
                times[name].append(time.perf_counter() - started)
    for lm in (worker, in_loop):
        lm.close()
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"a batch call of R 26-token contexts, vocabulary {args.vocab}, median of {args.repeats}")
    print(
        "| R | batch call, worker thread (ms) | batch call, in the loop (ms) "
        "| validation + runner (ms) | batching's share, worker thread (ms) |"
    )
    print("|---|---|---|---|---|")
    for rows in args.rows:
        ms = asyncio.run(measure(rows, args.vocab, args.repeats))
        worker, in_loop, floor = ms.values()
        print(f"| {rows} | {worker:.3f} | {in_loop:.3f} | {floor:.3f} | {worker - floor:.3f} |")


if __name__ == "__main__":
    main()
