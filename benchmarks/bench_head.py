"""The output head and the log-softmax on the CPU: how the runner computes them against the plain way.

For a step of R rows of width H over a V-token vocabulary (float32), in turns
in one process, ``--repeats`` times each, the median of each:

* ``linear``: ``F.linear(hidden, weight)``, a transformers head's product;
* ``vocabulary-major``: ``(weight @ hidden.T).T`` made contiguous, the
  runner's product on the CPU (``genlm_backend.llm.hf.compat.head_vocabulary_major``);
* with ``--softmax``, each followed by the log-softmax: into a new tensor
  (``torch.log_softmax(logits, -1)``, what a plain loop does) for ``linear``,
  and where the logits lie (``out=logits``, the runner's
  ``fit_to_vocab(..., own=True)``) for ``vocabulary-major``.

Also the largest difference between the two products' logits (they agree
within rounding; MKL sums a few rows' products in another order).

    python benchmarks/bench_head.py                       # widths 256 and 576, 1 / 16 / 64 rows
    python benchmarks/bench_head.py --softmax --rows 64
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time


def _linear(weight, hidden, softmax: bool):
    import torch

    logits = torch.nn.functional.linear(hidden, weight)
    return torch.log_softmax(logits, -1) if softmax else logits


def _vocabulary_major(weight, hidden, softmax: bool):
    import torch

    from genlm_backend.llm.hf.compat import _vocabulary_major_product

    logits = _vocabulary_major_product(weight, hidden)
    return torch.log_softmax(logits, -1, out=logits) if softmax else logits


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 576])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--softmax", action="store_true", help="each product then its log-softmax")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)

    print(
        f"V = {args.vocab}, float32, {args.threads} threads, median of {args.repeats} in turns"
        + (", with the log-softmax" if args.softmax else "")
    )
    print(
        "| width | rows | linear (ms) | vocabulary-major (ms) | linear / vocabulary-major | largest difference |"
    )
    print("|---|---|---|---|---|---|")
    for width in args.widths:
        weight = torch.randn(args.vocab, width, generator=generator)
        for num_rows in args.rows:
            hidden = torch.randn(num_rows, width, generator=generator)

            variants = {
                "linear": functools.partial(_linear, weight, hidden, args.softmax),
                "vocabulary-major": functools.partial(
                    _vocabulary_major, weight, hidden, args.softmax
                ),
            }
            times: dict[str, list[float]] = {name: [] for name in variants}
            with torch.inference_mode():
                for run in variants.values():  # warm-up
                    run()
                for _ in range(args.repeats):
                    for name, run in variants.items():
                        start = time.perf_counter()
                        run()
                        times[name].append(time.perf_counter() - start)
                plain_logits, our_logits = (run() for run in variants.values())
                difference = (plain_logits - our_logits).abs().max().item()
            plain, ours = (1e3 * statistics.median(times[name]) for name in variants)
            print(
                f"| {width} | {num_rows} | {plain:.2f} | {ours:.2f} | {plain / ours:.2f}x "
                f"| {difference:.1e} |"
            )


if __name__ == "__main__":
    main()
