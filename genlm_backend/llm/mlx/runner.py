"""Batched next-token forward passes of an mlx-lm model, reusing cached prefixes.

No asyncio here: :meth:`MlxRunner.run` takes distinct requests and
returns a ``[B, V]`` torch tensor. The prefix-cache driver the transformers
backend uses (:class:`~genlm_backend.llm.runner.PrefixCacheDriver`) plans
each batch over the same :class:`~genlm_backend.cache.kv_tree.KVPrefixTree`;
:class:`MlxExecutor` executes each pass of the plan with MLX arrays: cached pieces several rows share (a
prompt) are read in place, once for all of them
(:meth:`~genlm_backend.llm.mlx.kv.BatchView.attend`); each row's own past is
copied into the pass's block, or a one-token step writes in place into the
block it extends (the SMC step); rows of different lengths are padded after
their tokens and masked. Several contexts sharing a prefix not cached yet get
that prefix computed once first.
"""

from __future__ import annotations

from collections.abc import Hashable

import mlx.core as mx
import numpy as np
import torch

from genlm_backend.cache import plan as planner
from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.cache.plan import LevelPolicy, PassPlan
from genlm_backend.llm.mlx import compat
from genlm_backend.llm.mlx.adapters import MlxAdapters
from genlm_backend.llm.mlx.kv import ForwardPass, KVLayout, MlxKVBlock
from genlm_backend.llm.runner import (
    ExecutorSupport,
    PassResult,
    PrefixCacheDriver,
    PrefixCacheRunner,
    Request,
    fit_to_vocab,
)

MIN_LEVEL_TOKENS = 32
"""Shortest cached piece read in place by the rows that share it (a shorter one is copied into each row)."""


class MlxExecutor:
    """Runs planned passes of an mlx-lm model over MLX blocks of the KV tree (see the module).

    Args:
        model: An mlx-lm model of an attention-only architecture.
        kv_tree: Where the passes' blocks are reserved.
        vocab_size: Columns of the output.
        prefill_step_size: Most tokens per row in one call of the model.
    """

    support = ExecutorSupport(adapters=True, captured_steps=False, exact_rows=False)

    def __init__(self, model, kv_tree: KVPrefixTree, vocab_size: int, prefill_step_size: int):
        self.model = model
        self.kv_tree = kv_tree
        self.vocab_size = vocab_size
        self.prefill_step_size = prefill_step_size
        self.layout = _probe_layout(model)
        self._split = compat.split_model(model)
        self.level_policy = LevelPolicy(
            enabled=compat.install_shared_attention(model),
            min_shared_tokens=MIN_LEVEL_TOKENS,
            min_prefill_tokens=MIN_LEVEL_TOKENS,
        )
        """When cached pieces are read in place (never, where the model's attention cannot be routed)."""

    def run_pass(self, plan: PassPlan, namespace: Hashable) -> PassResult:
        """One pass: the log-probabilities of its reads, in order, and the block written."""
        given = planner.pass_inputs(plan, 1 << 30)  # MLX takes each row's first position
        block = plan.extends if plan.extends is not None else self._block_with_pasts(plan, given)
        assert isinstance(block, MlxKVBlock), "MLX passes extend MLX blocks"
        inputs = mx.array(given.tokens)  # [B, num_new], each row's new tokens, then padding
        positions = mx.array([row.reused for row in plan.rows], dtype=mx.int32)
        starts = mx.array(given.row_starts, dtype=mx.int32)
        levels = [
            (piece, None if len(rows) == len(plan.rows) else rows) for piece, rows in given.levels
        ]
        reads = plan.reads  # (output index, row, new-token position)
        picked: list[mx.array] = []
        order: list[int] = []
        for begin in range(0, plan.num_new, self.prefill_step_size):
            end = min(plan.num_new, begin + self.prefill_step_size)
            forward = ForwardPass(
                block, plan.num_past + begin, end - begin, positions + begin, starts, levels
            )
            out = self._call(inputs[:, begin:end], forward)  # [B, L, D] hidden, or [B, L, V] logits
            here = [k for k, (_, _, at) in enumerate(reads) if begin <= at < end]
            if here:
                rows = mx.array([reads[k][1] for k in here])
                picked.append(out[rows, mx.array([reads[k][2] - begin for k in here])])
                order.extend(here)
            mx.eval(picked, block.arrays())
            self._check_shared_reads(forward)
        selected = mx.concatenate(picked)[mx.array(np.argsort(order))]
        logits = selected if self._split is None else self._split[1](selected)
        return PassResult(_to_logprobs(logits, self.vocab_size), block, plan.placements)

    def _call(self, inputs: mx.array, forward: ForwardPass) -> mx.array:
        if self._split is None:
            return self.model(inputs, cache=forward.views())
        return self._split[0](inputs, cache=forward.views())

    def _check_shared_reads(self, forward: ForwardPass) -> None:
        if forward.levels and forward.num_shared_reads != len(forward.block.keys):
            self.level_policy = LevelPolicy(enabled=False)  # later batches copy every piece
            raise RuntimeError(
                f"{type(self.model).__module__}: only {forward.num_shared_reads} of "
                f"{len(forward.block.keys)} layers read the shared prefix through mlx-lm's "
                "scaled_dot_product_attention; this batch failed, later ones copy prefixes per row"
            )

    def _block_with_pasts(self, plan: PassPlan, given: planner.PassInputs) -> MlxKVBlock:
        """A block of ``num_past + num_new`` slots (and spare ones) with each row's own past right-aligned at ``num_past``."""
        num_past, num_new = plan.num_past, plan.num_new
        # One-token steps get spare slots, so the next steps can write in place.
        num_spare = planner.spare_slots(num_past) if num_new == 1 else 0
        num_slots = num_past + num_new + num_spare
        pinned = [entry for row in plan.rows for entry, _ in row.levels + row.own]
        self.kv_tree.reserve(self.layout.nbytes(len(plan.rows), num_slots), pinned=pinned)
        block = MlxKVBlock.zeros(self.layout, len(plan.rows), num_slots)
        block.copy_in(given.copies)
        return block


class MlxRunner(PrefixCacheRunner):
    """Turns batches of requests into next-token log-probabilities with KV-prefix reuse.

    Args:
        model: An mlx-lm model of an attention-only architecture.
        kv_tree: Where keys/values are looked up and left.
        vocab_size: Columns of the output (extra logit columns are dropped,
            missing ones are ``-inf``).
        prefill_step_size: Most tokens per row in one call of the model (a
            longer prefill runs in chunks, bounding its working memory).

    Raises:
        ValueError: a recurrent or hybrid model, or ``prefill_step_size`` < 1.
        ImportError: an untested mlx-lm version.
    """

    def __init__(self, model, kv_tree: KVPrefixTree, vocab_size: int, prefill_step_size: int):
        compat.check_mlx_lm_version()
        compat.check_attention_only(model)
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        # Weights still to be computed (a lazy load) are bound to this thread's stream;
        # the batcher's worker thread must find them computed.
        mx.eval(model.parameters())
        self.model = model
        self.executor = MlxExecutor(model, kv_tree, vocab_size, prefill_step_size)
        driver = PrefixCacheDriver(kv_tree, self.executor, vocab_size)
        super().__init__(driver, MlxAdapters(model), torch.device("cpu"))
        compat.clear_at_exit(self)

    @property
    def layout(self) -> KVLayout:
        return self.executor.layout

    def run_uncached(self, request: Request) -> torch.Tensor:
        """Reference: one plain mlx-lm forward over the whole context under its adapter, no cache."""
        with self.adapters.active(request.adapter):
            logits = self.model(mx.array([list(request.context)]))[:, -1]
            return _to_logprobs(logits, self.vocab_size)[0]

    def clear(self) -> None:
        super().clear()
        mx.clear_cache()


def _to_logprobs(logits: mx.array, vocab_size: int) -> torch.Tensor:
    """``[B, V_model]`` MLX logits -> ``[B, vocab_size]`` float32 torch log-probabilities on the CPU."""
    logits = logits.astype(mx.float32)
    mx.eval(logits)
    return fit_to_vocab(torch.from_numpy(np.array(logits, copy=True)), vocab_size, own=True)


def _probe_layout(model) -> KVLayout:
    """The shape and dtype of ``model``'s keys/values, from a one-token forward pass."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    keys, values = caches[0].keys, caches[0].values  # [1, Hkv, T, D] each
    return KVLayout(
        num_layers=len(caches),
        num_kv_heads=keys.shape[1],
        key_dim=keys.shape[3],
        value_dim=values.shape[3],
        dtype=keys.dtype,
    )
