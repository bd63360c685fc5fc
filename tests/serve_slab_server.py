"""The server's side of a slab, in a process of its own (as in a real server).

``serve_slab_server.py NAME NONCE_HEX CAPACITY VOCAB`` opens the slab and
prints ``mapped`` (or ``refused: REASON``), then follows stdin lines:
``write SEED N`` writes :func:`rows_of` ``(SEED, N, VOCAB)`` and prints
``written`` (or ``refused: REASON``); ``close`` closes it and prints ``closed``.
A process of its own, as in a real server: a fault of the server's side
(a ``SIGBUS``) ends that process, not the test's.
"""

from __future__ import annotations

import sys

import torch

from genlm_backend.llm.remote.slab import SlabRefused, SlabWriter


def rows_of(seed: int, num_rows: int, vocab_size: int) -> torch.Tensor:
    """The rows ``write SEED N`` writes: normalized float32 ``[N, vocab_size]``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator).log_softmax(-1)


def main() -> None:
    name, nonce, capacity, vocab = sys.argv[1], bytes.fromhex(sys.argv[2]), *map(int, sys.argv[3:5])
    try:
        slab = SlabWriter.attach(name, nonce, capacity, vocab)
    except SlabRefused as exc:
        print(f"refused: {exc}", flush=True)
        return
    print("mapped", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "write":
            try:
                slab.write(list(rows_of(int(args[0]), int(args[1]), vocab)))
            except SlabRefused as exc:
                print(f"refused: {exc}", flush=True)
            else:
                print("written", flush=True)
        elif command == "close":
            slab.close()
            print("closed", flush=True)


if __name__ == "__main__":
    main()
