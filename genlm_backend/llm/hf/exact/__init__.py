"""Exact rows: a context's row has the same bits whatever shares its pass and whatever the cache holds.

What makes a row depend on its neighbours in a plain forward pass, and what this module does about it:

* **Matrix products of few rows.** torch's CPU products give a row other
  bits when the product has fewer than a few rows (measured on torch 2.13:
  1 to 3 rows, and 7 on two threads) than in any product of 16 rows or more,
  where a row's bits depend neither on the other rows nor on its position.
  :class:`PaddedMatmuls` pads every projection's input to 16 rows.
  cuBLAS picks its kernel by the row count: a float32 row got other bits
  beside 16 to 127 others than alone (an H100, torch 2.11). On CUDA every
  product is computed in pieces of :data:`CUDA_ROWS` rows, one kernel shape
  whatever the pass holds; rows are exact there in bfloat16
  (:func:`exact_rows_unsupported`).
* **Attention's reduction order.** A fused kernel splits the keys into
  blocks whose size depends on the number of keys and queries, and the
  runner's cascade merges a cached prefix with the rest at the prefix's
  end. :func:`exact_attention` splits every query's keys at fixed positions
  (``0, b, 2b, ...``, ``b = BLOCK_TOKENS``), weighs every key by
  ``exp(score - top)``, ``top`` the query's highest score over its whole
  context (an exact maximum, whatever the order), computes each block with the
  same products (16 query rows or more, ``b`` keys, masked keys weighing an
  exact zero, operands in one memory layout), sums each span of
  :data:`SPAN_BLOCKS` blocks, then the spans, with sums of a fixed shape
  (:func:`span_sums`, :func:`sum_in_halves`). A block is computed from
  wherever the tree holds its keys: a level held once for many rows (the
  planner's levels start and end at span boundaries:
  ``LevelPolicy.block_tokens``, so a level's spans are summed once for all
  its readers), or the row's own part. A captured one-token step lays the
  same computation out on the device from the step's inputs
  (:meth:`ExactLayout.of_step`).
* **Elementwise ``exp``.** torch computes the elements past a range's last
  whole vectorized step in a scalar loop that rounds otherwise, and where a
  range ends depends on the tensor's size: :func:`exp_of_difference`.

Everything else a decoder layer does is per row: embeddings, norms, rotary
embeddings, activations, the log-softmax; except, on CUDA, a norm's mean,
whose reduction splits a row among more threads when a pass has few rows
(computed one row per program there: ``exact_fused.RowMeans``).

Each device computes exact attention in one fixed order over the same
:class:`ExactLayout`, chosen by :class:`ExactAttention`
(:class:`ExactAttention`): on the CPU span by span through torch's fused
CPU attention kernel (:mod:`~genlm_backend.llm.hf.exact_spans`); on CUDA,
where Triton is installed, in :mod:`~genlm_backend.llm.hf.exact_fused`'s
kernels (:func:`uses_fused_kernels`); elsewhere, and on CUDA for head sizes
that are not powers of two, in :func:`exact_attention`'s torch operations.
"""

from __future__ import annotations

import contextlib

import torch

from genlm_backend.cache.plan import LevelPolicy, PassPlan
from genlm_backend.llm.hf.attention import Level
from genlm_backend.llm.hf.exact.layout import ExactLayout
from genlm_backend.llm.hf.exact.numerics import (
    BLOCK_TOKENS,
    CUDA_ROWS,
    MIN_ROWS,
    QUERY_CHUNK,
    SPAN_BLOCKS,
    SPAN_TOKENS,
    aligned_numel,
    exact_rows_unsupported,
    exp_of_difference,
    pad_rows,
    span_sums,
    sum_in_halves,
    uses_fused_kernels,
)
from genlm_backend.llm.hf.exact.products import PaddedMatmuls, products_in_pieces
from genlm_backend.llm.hf.exact.spans import span_exact_attention
from genlm_backend.llm.hf.exact.torch_order import exact_attention, in_runs

__all__ = [
    "BLOCK_TOKENS",
    "CUDA_ROWS",
    "MIN_ROWS",
    "QUERY_CHUNK",
    "SPAN_BLOCKS",
    "SPAN_TOKENS",
    "ExactAttention",
    "ExactLayout",
    "ExactRows",
    "PaddedMatmuls",
    "aligned_numel",
    "exact_attention",
    "exact_rows_unsupported",
    "exp_of_difference",
    "in_runs",
    "pad_rows",
    "products_in_pieces",
    "span_sums",
    "sum_in_halves",
    "uses_fused_kernels",
]


class ExactAttention:
    """Exact attention over one pass's :class:`ExactLayout`, in the device's one fixed order: the
    fused kernels where they run (:func:`uses_fused_kernels`; head sizes that are powers of
    two), on the CPU span by span in torch's CPU attention kernel
    (:func:`~genlm_backend.llm.hf.exact.spans.span_exact_attention`), else
    :func:`~genlm_backend.llm.hf.exact.torch_order.exact_attention`'s torch operations."""

    optional = False

    def __init__(self, layout: ExactLayout):
        self.layout = layout

    def attend(self, layer, query, key, value, mask, scale) -> torch.Tensor:
        head_dim = query.shape[-1]
        if not head_dim & (head_dim - 1) and uses_fused_kernels(query.device):
            from genlm_backend.llm.hf.exact.fused import fused_exact_attention

            return fused_exact_attention(layer, query, key, value, scale, self.layout)
        if query.device.type == "cpu":
            return span_exact_attention(layer, query, key, value, scale, self.layout)
        return exact_attention(layer, query, key, value, scale, self.layout)


class ExactRows:
    """Deterministic mode's rows: each has the bits of its context computed alone from an empty
    cache, whatever shares its pass and whatever the tree holds.

    Levels start and end at span boundaries (their spans are summed once for
    all their readers), attention is :class:`ExactAttention`, and while a pass
    runs every projection computes rows of a fixed shape (:class:`PaddedMatmuls`)
    and, where the fused kernels run, a norm's mean one row per program
    (:class:`~genlm_backend.llm.hf.exact.fused.RowMeans`).

    Raises:
        ValueError: a model whose attention the runner cannot compute itself
            (``levels_unsupported`` says why), or a device and dtype where rows
            are not exact (:func:`exact_rows_unsupported`).
    """

    def __init__(self, model: torch.nn.Module, levels_unsupported: str | None):
        if levels_unsupported is not None:
            raise ValueError(
                f"deterministic=True needs attention the runner computes itself; this model's "
                f"cannot be: {levels_unsupported}"
            )
        where = next(model.parameters())
        refused = exact_rows_unsupported(where.device, where.dtype)
        if refused is not None:
            raise ValueError(f"deterministic=True: {refused}")
        self.device = where.device
        self.padded_matmuls = PaddedMatmuls.of(model)

    def level_policy(self, enabled: bool) -> LevelPolicy:
        return LevelPolicy(enabled=enabled, block_tokens=SPAN_TOKENS)

    def attention(
        self, plan: PassPlan, levels: list[Level], num_groups: int, num_slots: int
    ) -> ExactAttention:
        return ExactAttention(ExactLayout.of(plan, levels, num_groups, self.device))

    def step_attention(self, levels, offsets, inputs, num_groups, num_slots) -> ExactAttention:
        splits, firsts, writes = inputs
        placed = [(level, offset // SPAN_TOKENS) for level, offset in zip(levels, offsets)]
        return ExactAttention(
            ExactLayout.of_step(splits, firsts, writes, placed, num_groups, num_slots)
        )

    @contextlib.contextmanager
    def products(self, model: torch.nn.Module):
        """While active, projections compute at least 16 rows, and (where the fused kernels
        run) a norm's mean one row per program."""
        self.padded_matmuls.active = True
        try:
            if uses_fused_kernels(self.device):
                from genlm_backend.llm.hf.exact.fused import RowMeans

                with RowMeans():
                    yield
            else:
                yield
        finally:
            self.padded_matmuls.active = False

    def attach(self, model: torch.nn.Module) -> None:
        self.padded_matmuls.attach(model)  # an adapter's projections
