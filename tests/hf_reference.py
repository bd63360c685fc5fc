"""The reference for transformers-backend tests: a plain uncached forward, and random workloads.

Reference: ``log_softmax(model(full_context).logits[-1])`` in fp32, one context
at a time, no cache. Tolerance: 1e-4 absolute on log-probabilities (a bfloat16
model's rows: :data:`BF16_STEPS`, :func:`bfloat16_tolerance`).
:class:`Reference` computes it on a copy of the model taken before any code under
test touched it, with adapters loaded by peft itself: no path of the runners'.
"""

from __future__ import annotations

import copy
import random

import torch

from genlm_backend.llm.hf import AsyncTransformer

ATOL = 1e-4
BF16_STEPS = 4
"""A bfloat16 model's rows against its plain forward: within this many rounding steps
``eps * max|logit|`` of the plain forward's row of logits (``eps = 2**-7``: bfloat16 keeps 8
significant bits). Two bfloat16 forwards summing in different orders round each logit about a
step apart, and a log-probability subtracts a log-sum-exp rounded alike. Measured on CPU between
deterministic rows and the plain forward: up to 1.5 steps on SmolLM2-135M (0.31 at logits near
27), 1 on the tiny random models (0.008)."""


def reference(model, context) -> torch.Tensor:
    with torch.inference_mode():
        device = next(model.parameters()).device
        logits = model(torch.tensor([list(context)], device=device), use_cache=False).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def plain_logits(model, context) -> torch.Tensor:
    """``model``'s logits at every position of ``context``, one uncached forward: float32
    ``[len(context), V]`` (row ``i`` is the plain forward of ``context[: i + 1]``, causally)."""
    with torch.inference_mode():
        device = next(model.parameters()).device
        logits = model(torch.tensor([list(context)], device=device), use_cache=False).logits[0]
    return logits.float()


def bfloat16_tolerance(logits: torch.Tensor) -> float:
    """Absolute tolerance on the log-probabilities of a bfloat16 model's row whose plain
    forward gave ``logits`` (``[V]``): :data:`BF16_STEPS` rounding steps at its largest logit."""
    return BF16_STEPS * torch.finfo(torch.bfloat16).eps * logits.abs().max().item()


class Reference:
    """Rows of a pristine copy of ``model`` (taken now), under adapters peft loads from their folders.

    Args:
        model: A transformers causal LM, before a runner wraps or changes it.
        vocab_size: The runner's vocabulary (rows are cut to it).
    """

    def __init__(self, model, vocab_size: int):
        self._base = copy.deepcopy(model).eval()
        self._adapted: dict[str, object] = {}
        self.vocab_size = vocab_size

    def row(self, context, adapter_path: str | None = None) -> torch.Tensor:
        model = self._base if adapter_path is None else self._with_adapter(adapter_path)
        return reference(model, context)[: self.vocab_size]

    def of(self, request) -> torch.Tensor:
        """The row of a runner ``Request`` (its adapter's folder, its context)."""
        return self.row(request.context, None if request.adapter is None else request.adapter.path)

    def _with_adapter(self, path: str):
        if path not in self._adapted:
            import peft

            base = copy.deepcopy(self._base).to(next(self._base.parameters()).device)
            self._adapted[path] = peft.PeftModel.from_pretrained(base, path).eval()
        return self._adapted[path]


def assert_matches_reference(llm: AsyncTransformer, context, result: torch.Tensor) -> None:
    expected = reference(llm.model, context)[: llm.vocab_size]
    assert result.dtype == torch.float32 and result.shape == (llm.vocab_size,)
    torch.testing.assert_close(result, expected, atol=ATOL, rtol=0)


def random_workload(rng: random.Random, vocab: int, num_rounds: int, per_round: int):
    """Rounds of concurrent contexts: extensions, siblings, prefixes (deep-then-shallow) and fresh ones."""
    seen: list[list[int]] = [[rng.randrange(vocab) for _ in range(rng.randint(3, 12))]]
    for _ in range(num_rounds):
        batch = []
        for _ in range(per_round):
            base = rng.choice(seen)
            kind = rng.random()
            if kind < 0.5:
                context = base + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            elif kind < 0.7:
                context = base[: rng.randint(1, len(base))]
            elif kind < 0.9:
                cut = rng.randint(1, len(base))
                context = base[:cut] + [rng.randrange(vocab)]
            else:
                context = [rng.randrange(vocab) for _ in range(rng.randint(1, 15))]
            batch.append(context)
        seen.extend(batch)
        yield batch
