"""The output head and the log-softmax on the CPU: how the runner computes them against the plain way.

Two measures, in one process:

* **The runner's step** (``--prompts``): ``HFRunner.run`` of 64 particles
  behind a T-token prompt (``bench_engine.py``'s 2-layer Llama, SmolLM2's
  49,152-token vocabulary, each particle taking the row's argmax), the way
  of computing the head and the log-softmax switched at every step of one
  run (so the machine's drift and the allocator's state are shared), the
  rows of the last two steps held as the engine's output cache holds them:

  * ``runner``: as the runner computes them on the CPU: the head as
    ``weight @ hidden.T`` copied into rows
    (``genlm_backend.llm.hf.compat.head_vocabulary_major``), the log-softmax
    written into the logits (``fit_to_vocab(..., own=True)``);
  * ``plain``: transformers' head (``F.linear``) and the log-softmax into a
    new tensor, as a plain decode loop computes them;
  * ``head only`` / ``in place only``: one of the two.

  The median step of each, over ``--runs`` runs of 36 timed steps shared
  out among them.
* **The product alone** (``--widths``, ``--rows``): ``F.linear(hidden, weight)``,
  ``weight @ hidden.T`` in one piece made contiguous, and the runner's
  product (the same a block of the vocabulary at a time, each block copied
  into the rows), in turns, ``--repeats`` times, the median of each, and the
  largest difference between the runner's logits and ``F.linear``'s (they
  agree within rounding: MKL sums a few rows' products in another order).
  Alone, the products' times swing with the machine more than in a step.

    python benchmarks/bench_head.py                      # both
    python benchmarks/bench_head.py --prompts 64 --runs 4 --widths
    python benchmarks/bench_head.py --prompts --widths 256 1024 --blocks 512 1024 4096
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

WAYS = ("runner", "plain", "head only", "in place only")
NUM_PARTICLES = 64
NUM_STEPS = 40
NUM_WARM_UP_STEPS = 4
NUM_HELD = 2
"""Steps whose rows stay alive, as the engine's output cache holds the last steps' blocks at
its first limit (so a step's output is new memory, not the last step's)."""


def runner_steps(prompt_tokens: int, runs: int) -> dict[str, list[float]]:
    """Each way's step times (seconds), the way switched at every step of each run."""
    from bench_engine import small_llama
    from bench_long_prompt import token_draws

    from genlm_backend.cache.kv_tree import untracked
    from genlm_backend.llm import runner as runner_module
    from genlm_backend.llm.hf import AsyncTransformer
    from genlm_backend.llm.hf import runner as hf_runner
    from genlm_backend.llm.runner import Request

    model = small_llama()
    vocab = model.config.vocab_size
    prompt, own = token_draws(vocab, NUM_PARTICLES, 1, prompt_tokens)
    head, fit = hf_runner.head_vocabulary_major, runner_module.fit_to_vocab

    def plain_head(model):
        return contextlib.nullcontext()

    def new_tensor(logits, vocab_size, own=False):
        return fit(logits, vocab_size)

    ways = {
        "runner": (head, fit),
        "plain": (plain_head, new_tensor),
        "head only": (head, new_tensor),
        "in place only": (plain_head, fit),
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for run in range(runs):
            llm = AsyncTransformer(model, None, byte_vocab=[b"<%d>" % i for i in range(vocab)])
            runner = llm.runner
            runner.run([Request(None, tuple(prompt))])
            contexts = [untracked((*prompt, first)) for first, *_ in own]
            parents: list = [None] * len(contexts)
            held: list = []
            for step in range(NUM_STEPS):
                way = WAYS[(step + run) % len(WAYS)]
                hf_runner.head_vocabulary_major, hf_runner.fit_to_vocab = ways[way]
                requests = [Request(None, c, p) for c, p in zip(contexts, parents)]
                start = time.perf_counter()
                rows = runner.run(requests)
                chosen = rows.argmax(-1).tolist()
                if step >= NUM_WARM_UP_STEPS:
                    times[way].append(time.perf_counter() - start)
                held = [*held[1 - NUM_HELD :], rows]  # as the engine's output cache holds them
                del rows
                parents = contexts
                contexts = [untracked((*c, token)) for c, token in zip(contexts, chosen)]
            llm.close()
    finally:
        hf_runner.head_vocabulary_major, hf_runner.fit_to_vocab = head, fit
    return times


def products(
    widths: list[int], rows: list[int], vocab: int, repeats: int, blocks: list[int]
) -> None:
    import functools

    import torch

    from genlm_backend.llm.hf.compat import HEAD_BLOCK_ROWS, _vocabulary_major_product

    def whole(weight, hidden):  # the vocabulary-major product in one piece, copied into rows
        return torch.mm(weight, hidden.T).T.contiguous()

    ways = {
        "F.linear": lambda weight, hidden: torch.nn.functional.linear(hidden, weight),
        "whole": whole,
        "blocks": _vocabulary_major_product,
    }
    for block_rows in blocks:  # other block sizes, for the choice of HEAD_BLOCK_ROWS
        ways[f"blocks of {block_rows}"] = functools.partial(
            _vocabulary_major_product, block_rows=block_rows
        )
    others = [way for way in ways if way.startswith("blocks of ")]
    generator = torch.Generator().manual_seed(0)
    print(f"\nThe product alone: V = {vocab}, float32, median of {repeats} in turns")
    print(
        "| width | rows | F.linear (ms) | weight @ hidden.T whole (ms) "
        f"| in blocks of {HEAD_BLOCK_ROWS} (ms) | F.linear / blocks | whole / blocks "
        + "".join(f"| {way} (ms) " for way in others)
        + "| largest difference |"
    )
    print("|---" * (7 + len(others)) + "|")
    for width in widths:
        weight = torch.randn(vocab, width, generator=generator)
        for num_rows in rows:
            hidden = torch.randn(num_rows, width, generator=generator)
            times: dict[str, list[float]] = {way: [] for way in ways}
            with torch.inference_mode():
                plain = ways["F.linear"](weight, hidden)
                ours = _vocabulary_major_product(weight, hidden)
                for _ in range(repeats):
                    for way, product in ways.items():
                        start = time.perf_counter()
                        product(weight, hidden)
                        times[way].append(time.perf_counter() - start)
            ms = {way: 1e3 * statistics.median(t) for way, t in times.items()}
            difference = (plain - ours).abs().max().item()
            print(
                f"| {width} | {num_rows} | {ms['F.linear']:.2f} | {ms['whole']:.2f} | "
                f"{ms['blocks']:.2f} | {ms['F.linear'] / ms['blocks']:.2f}x | "
                f"{ms['whole'] / ms['blocks']:.2f}x | "
                + "".join(f"{ms[way]:.2f} | " for way in others)
                + f"{difference:.1e} |"
            )


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="*", default=[64, 4096])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--widths", type=int, nargs="*", default=[256, 576])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--blocks", type=int, nargs="*", default=[], help="other block sizes of the product"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.prompts:
        print(
            f"The runner's step: {NUM_PARTICLES} particles, 2-layer model, float32, "
            f"{args.threads} threads; median over {args.runs} runs, the way switched every step"
        )
        print("| prompt | way | step (ms, median) | quartiles (ms) | vs plain |")
        print("|---|---|---|---|---|")
        for prompt_tokens in args.prompts:
            times = runner_steps(prompt_tokens, args.runs)
            plain = statistics.median(times["plain"])
            for way in WAYS:
                values = sorted(times[way])
                quartiles = statistics.quantiles(values, n=4)
                print(
                    f"| {prompt_tokens} | {way} | {1e3 * statistics.median(values):.2f} "
                    f"| {1e3 * quartiles[0]:.2f} to {1e3 * quartiles[2]:.2f} "
                    f"| {statistics.median(values) / plain:.2f}x |"
                )
    if args.widths:
        products(args.widths, args.rows, args.vocab, args.repeats, args.blocks)


if __name__ == "__main__":
    main()
