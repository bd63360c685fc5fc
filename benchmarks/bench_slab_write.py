"""A server's write of a batch's rows into a client's slab: a sealed slab's mapping against a
named slab's descriptor (``pwritev``).

Rows are separate float32 tensors of SmolLM2's vocabulary (49,152), as a
server's output cache holds them; the slab is made in this process (the
copy is the same whichever process made it). Each write goes to the lent
region after the scratch one, alternately the first and the second (as a
client's batches do); the median of ``--repeats`` writes, kinds in turns.
``--threads`` sets torch's intra-op threads (a sealed slab's copy is
numpy's, on the calling thread, whatever it is).

    python benchmarks/bench_slab_write.py [--rows 1 16 64] [--repeats 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from genlm_backend.llm.remote.slab import HAS_SEALED, Slab, SlabWriter

VOCAB = 49152


def write_ms(sealed: bool, num_rows: int, repeats: int) -> float:
    """Median milliseconds of one write of ``num_rows`` rows into a slab of three batches."""
    rows = [torch.randn(VOCAB).log_softmax(-1) for _ in range(num_rows)]
    slab = Slab.create(3 * num_rows, VOCAB, sealed)
    writer = SlabWriter.attach(slab.name, slab.nonce, 3 * num_rows, VOCAB)
    try:
        assert writer.is_mapped == sealed
        times = []
        for i in range(3 + repeats):
            started = time.perf_counter()
            writer.write(rows, first_row=num_rows * (1 + i % 2))
            if i >= 3:
                times.append(time.perf_counter() - started)
        for i, row in enumerate(rows):  # the rows arrived whole
            assert torch.equal(slab.read(1, num_rows * (1 + (repeats + 2) % 2) + i)[0], row)
        return 1e3 * statistics.median(times)
    finally:
        writer.close()
        slab.close()
        slab.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = [True, False] if HAS_SEALED else [False]
    figures: dict[tuple[int, bool], list[float]] = {}
    for _ in range(args.rounds):
        for num_rows in args.rows:
            for sealed in kinds:
                figures.setdefault((num_rows, sealed), []).append(
                    write_ms(sealed, num_rows, args.repeats)
                )
    print(f"a server's write of R rows of {VOCAB} float32, median of {args.repeats} a round")
    print("| rows | sealed slab, mapped (ms) | named slab, pwritev (ms) | named / sealed |")
    print("|---|---|---|---|")
    for num_rows in args.rows:
        named = statistics.median(figures[num_rows, False])
        if HAS_SEALED:
            sealed_ms = statistics.median(figures[num_rows, True])
            print(f"| {num_rows} | {sealed_ms:.3f} | {named:.3f} | {named / sealed_ms:.2f}x |")
        else:
            print(f"| {num_rows} | - | {named:.3f} | - |")


if __name__ == "__main__":
    main()
