"""What a particle's ``await next_token_logprobs`` costs with no model work, in the two shapes
programs await it, against asyncio's floor for the same shape, in one process.

The mock backend's runner hands back one ready-made ``[N, V]`` block, so
every microsecond is the service's host work (validation, queue, step,
settling) or asyncio's. ``N`` particles x ``S`` steps; each particle draws
its next token from its row (``int(row[:64].argmax())``), as
``../shared/tools/await_cost.py`` does.

* ``gathered``: ``await asyncio.gather(*(llm.next_token_logprobs(c) for c in ...))``,
  the calls themselves gathered (what ``await_cost.py`` times). Floors: the
  same number of bare futures, each in a coroutine of its own (``await_cost.py``'s
  floor), and gathered as they are (no coroutine: the least asyncio can do).
* ``particles``: each particle a coroutine that awaits its call
  (``async def step(c): return await llm.next_token_logprobs(c)``), the
  shape SMC libraries use. Floor: the same coroutines awaiting bare futures.

Each figure is the median over ``--runs`` runs, in turns; us a request.

    python benchmarks/bench_await.py [--particles 64] [--steps 200] [--runs 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def next_tokens(contexts, rows, step):
    return [
        c + [(int(r[:64].argmax()) + 7 * i + step) % 5000 + 100]
        for i, (c, r) in enumerate(zip(contexts, rows))
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    n, num_steps = args.particles, args.steps

    import torch

    from genlm_backend.llm.mock import MockAsyncLM, MockRunner
    from genlm_backend.models import load_tokenizer_by_name

    torch.set_num_threads(1)

    class ReadyRows(MockRunner):
        """Rows computed once: the runner's own work is a slice."""

        def __init__(self, vocab_size, device):
            super().__init__(vocab_size, device)
            self.block = torch.log_softmax(torch.randn(n, vocab_size), -1)

        def run(self, requests):
            return self.block[: len(requests)]

    llm = MockAsyncLM(load_tokenizer_by_name(None))
    llm.engine.runner = llm.runner = ReadyRows(llm.vocab_size, llm.device)
    block = llm.runner.block

    async def step(context):
        return await llm.next_token_logprobs(context)

    async def one(future):
        return await future

    async def ours(shape: str) -> float:
        contexts = [[100 + i] for i in range(n)]
        await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
        start = time.perf_counter()
        for s in range(num_steps):
            if shape == "gathered":
                rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
            else:
                rows = await asyncio.gather(*(step(c) for c in contexts))
            contexts = next_tokens(contexts, rows, s)
        return (time.perf_counter() - start) / num_steps / n * 1e6

    async def floor(shape: str) -> float:
        loop = asyncio.get_running_loop()
        contexts = [[100 + i] for i in range(n)]

        def resolve(futures):
            for i, future in enumerate(futures):
                future.set_result(block[i])

        start = time.perf_counter()
        for s in range(num_steps):
            futures = [loop.create_future() for _ in contexts]
            loop.call_soon(resolve, futures)
            if shape == "bare":
                rows = await asyncio.gather(*futures)
            else:
                rows = await asyncio.gather(*(one(f) for f in futures))
            contexts = next_tokens(contexts, rows, s)
        return (time.perf_counter() - start) / num_steps / n * 1e6

    cases = {
        "ours, gathered calls": lambda: ours("gathered"),
        "ours, particle coroutines": lambda: ours("particles"),
        "floor, futures in coroutines": lambda: floor("coroutines"),
        "floor, bare futures": lambda: floor("bare"),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, case in cases.items():
            times[name].append(asyncio.run(case()))
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"{n} particles x {num_steps} steps, median of {args.runs} runs in turns, us a request")
    for name, value in median.items():
        print(f"  {name:30s} {value:6.2f}   ({', '.join(f'{v:.1f}' for v in times[name])})")
    coroutines = median["floor, futures in coroutines"]
    print(
        f"gathered calls / floor in coroutines (await_cost.py's ratio): "
        f"{median['ours, gathered calls'] / coroutines:.2f}x"
    )
    print(
        f"gathered calls / bare futures: "
        f"{median['ours, gathered calls'] / median['floor, bare futures']:.2f}x"
    )
    print(
        f"particle coroutines / floor in coroutines: "
        f"{median['ours, particle coroutines'] / coroutines:.2f}x"
    )


if __name__ == "__main__":
    main()
