"""Shared pieces of the trie stress tests: an instrumented trie, tagged weights, the float64 check."""

from __future__ import annotations

import threading

import numpy as np
import torch

from genlm_backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
from tests.stress.helpers import WAIT_S

OPS = ("sum", "max", "logsumexp")


class StressTrie(ParallelTokenCharacterTrie):
    """Counts reduced rows; can hold the next ``_reduce`` until released, or raise planned errors.

    ``entered`` is set when a ``_reduce`` starts, ``returned`` when one ends
    (returned or raised).

    Every weight vector of these tests carries its request number in entry 0,
    so ``batches`` records exactly which requests each ``_reduce`` call held.
    """

    def __init__(self, vocab):
        super().__init__(vocab, device="cpu")
        self.batches: list[list[int]] = []
        self.planned_errors: dict[int, BaseException] = {}
        self.entered, self.release = threading.Event(), threading.Event()
        self.returned = threading.Event()
        self.release.set()

    def hold_next(self) -> None:
        self.entered.clear()
        self.returned.clear()
        self.release.clear()

    def _reduce(self, ws, op):
        self.batches.append([int(w) for w in ws[:, 0].tolist()])
        self.entered.set()
        try:
            if not self.release.wait(WAIT_S):
                raise TimeoutError("the held batch was never released")
            error = self.planned_errors.pop(len(self.batches) - 1, None)
            if error is not None:
                raise error
            return super()._reduce(ws, op)
        finally:
            self.returned.set()


def weights(rng: np.random.Generator, vocab_size: int, op: str, number: int) -> torch.Tensor:
    """A random next-token distribution (log-probabilities for logsumexp) tagged with ``number``."""
    logprobs = torch.log_softmax(
        torch.from_numpy(rng.standard_normal(vocab_size) * 2), dim=0
    ).float()
    ws = logprobs if op == "logsumexp" else logprobs.exp()
    ws[0] = number
    return ws


def check(reference: TokenCharacterTrie, calls: list[tuple[str, torch.Tensor]], results) -> None:
    """Each result equals the float64 trie on the same (float32) weights."""
    for op in OPS:
        chosen = [(ws, got) for (o, ws), got in zip(calls, results) if o == op]
        if not chosen:
            continue
        want = getattr(reference, f"batch_weight_{op}")(
            torch.stack([ws for ws, _ in chosen]).double().numpy()
        )
        got = np.stack([np.asarray(got) for _, got in chosen]).astype(np.float64)
        if op == "max":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 if op == "logsumexp" else 0)
