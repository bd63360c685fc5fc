"""The cost of ``deterministic=True``: SMC-shaped decoding with exact rows against the default mode.

Each setup runs P particles for S steps behind a shared prompt on the
default model (SmolLM2-135M-Instruct, float32), as a client does: every step
awaits all particles' rows together and draws each particle's next token from
its row. Both modes run in this process, alternating, on fresh backends; the
prompt's prefill is timed apart from the steps. Reports each mode's median
over the rounds and their ratio.

    python benchmarks/bench_deterministic.py [--rounds 3] [--attention]

With ``--attention``, also the seconds the decode spent in the runner's
attention function (both modes call it; the rest of a step is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from genlm_backend.llm import AsyncTransformer
from genlm_backend.models import default_model_dir

SETUPS = {"16x32 behind 25": (16, 32, 25), "32x16 behind 4096": (32, 16, 4096)}


class AttentionClock:
    """Seconds spent in the runner's attention function while :attr:`on`."""

    def __init__(self):
        from genlm_backend.llm.hf import compat

        self.on, self.seconds = False, 0.0
        real = compat._genlm_attention

        def timed(*args, **kwargs):
            if not self.on:
                return real(*args, **kwargs)
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        compat._genlm_attention = timed


def run_once(
    model,
    tokenizer,
    deterministic: bool,
    particles: int,
    steps: int,
    prompt_len: int,
    clock: AttentionClock | None = None,
):
    """(prefill seconds, decode seconds, decode seconds in attention) of one run on a fresh backend."""
    llm = AsyncTransformer(model, tokenizer, deterministic=deterministic, output_cache_bytes=0)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 2000, (prompt_len,), generator=generator).tolist()

    async def run():
        start = time.perf_counter()
        await llm.next_token_logprobs(prompt)
        prefilled = time.perf_counter()
        contexts = [[*prompt] for _ in range(particles)]
        if clock is not None:
            clock.on, clock.seconds = True, 0.0
        for _ in range(steps):
            rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
            for context, row in zip(contexts, rows):
                context.append(int(torch.multinomial(row.exp(), 1, generator=generator)))
        decoded = time.perf_counter() - prefilled
        if clock is not None:
            clock.on = False
        return prefilled - start, decoded, clock.seconds if clock is not None else 0.0

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--attention", action="store_true", help="time the attention function too")
    args = parser.parse_args()
    clock = AttentionClock() if args.attention else None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.setups:
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for deterministic in (False, True):
                times[deterministic].append(
                    run_once(model, tokenizer, deterministic, *SETUPS[name], clock=clock)
                )
        parts = [("prefill", 0), ("decode", 1)] + ([("attention", 2)] if clock else [])
        for part, index in parts:
            default = statistics.median(t[index] for t in times[False])
            exact = statistics.median(t[index] for t in times[True])
            print(
                f"{name:18} {part:9}  default {default:7.3f} s  deterministic {exact:7.3f} s  "
                f"ratio {exact / default:5.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
