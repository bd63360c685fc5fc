"""One token drawn from one row: ``sample_token`` against a float64 softmax then a cumulative sum.

Both invert the CDF with the same uniform draw; the baseline is the formula
``sample_token`` used before (``softmax(row.double()).cumsum()``), the shape
most samplers write. Rows are log-probabilities of SmolLM2's and Llama-3's
vocabulary sizes, on the CPU with one torch thread (a served client's
setting) unless ``--threads``; interleaved, median of ``--repeats``.
The baseline's cost depends on the C heap's state: its fresh buffers fault
their pages in whenever the heap has given memory back (more buffers, as
with a temperature, make that likelier); ``sample_token`` keeps one buffer
per thread.

Usage::

    python benchmarks/bench_sampling.py
    python benchmarks/bench_sampling.py --vocab 128256 --temperature 0.7 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from genlm_backend.llm.sampling import sample_token


def softmax_then_cumsum(
    logits: torch.Tensor, generator: torch.Generator, temperature: float
) -> int:
    scaled = logits / temperature if temperature != 1 else logits
    cdf = torch.softmax(scaled.double(), dim=-1).cumsum_(0)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49_152, 128_256])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"one draw, median of {args.repeats} (us), {args.threads} torch thread(s), "
        f"temperature {args.temperature}"
    )
    print("| vocabulary | softmax then cumsum (us) | sample_token (us) | speedup | same tokens |")
    print("|---|---|---|---|---|")
    for vocab in args.vocab:
        row = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)).mul_(4)
        row = row.log_softmax(0)
        draws = [torch.Generator().manual_seed(0) for _ in range(2)]
        times: list[list[float]] = [[], []]
        same = 0
        for _ in range(args.repeats):
            tokens = []
            for k, draw in enumerate((softmax_then_cumsum, sample_token)):
                started = time.perf_counter()
                tokens.append(draw(row, draws[k], args.temperature))
                times[k].append(time.perf_counter() - started)
            same += tokens[0] == tokens[1]
        before, after = (1e6 * statistics.median(t) for t in times)
        print(
            f"| {vocab:,} | {before:.0f} | {after:.0f} | {before / after:.2f}x "
            f"| {same}/{args.repeats} |"
        )


if __name__ == "__main__":
    main()
