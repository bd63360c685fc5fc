"""Batched next-token forward passes of an mlx-lm model, reusing cached prefixes.

No asyncio here: :meth:`MlxRunner.logprobs` takes distinct contexts and
returns a ``[B, V]`` torch tensor. For each context it looks up the longest
cached prefix in a :class:`~genlm_backend.cache.kv_tree.KVPrefixTree`, runs
the model over the remaining tokens only (rows of different lengths padded
after their tokens and masked), and leaves the new keys/values in the tree.

A cached prefix that several rows of a batch continue (a prompt, at least
:data:`MIN_LEVEL_TOKENS` long) stays where it is and is read once for all
of them (:meth:`~genlm_backend.llm.mlx.kv.BatchView.attend`); each row's own
past is copied into the pass's block, right-aligned at one slot, or the
pass writes in place into the block it extends (the SMC step). Several
contexts sharing a prefix not cached yet get that prefix computed once first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import torch

from genlm_backend.cache.kv_block import extendable_block
from genlm_backend.cache.kv_tree import KVEntry, KVPrefixTree, Placement
from genlm_backend.llm.mlx import compat
from genlm_backend.llm.mlx.adapters import MlxAdapters
from genlm_backend.llm.mlx.kv import ForwardPass, KVLayout, MlxKVBlock, span
from genlm_backend.llm.runner import (
    Adapter,
    Request,
    RunnerStats,
    ScoreRequest,
    fit_to_vocab,
    group_by_adapter,
    score_from_rows,
)

MIN_LEVEL_TOKENS = 32
"""Shortest shared prefix read in place by every row; a shorter one is copied into each row."""


@dataclass
class Row:
    """One context of a pass: its cached part (``entry``, ``reused`` tokens) and its place in the batch."""

    index: int
    context: tuple[int, ...]
    entry: KVEntry | None
    reused: int
    level: KVEntry | None = None
    """The shared prefix read in place (``None``: the row's whole past is in the pass's block)."""

    @property
    def num_new(self) -> int:
        return len(self.context) - self.reused

    @property
    def own_pieces(self) -> list[tuple[KVEntry, int]]:
        """Where the row's past after its level is: ``[(entry, n), ...]`` in order."""
        if self.entry is None:
            return []
        return [(e, n) for e, n in self.entry.pieces(self.reused) if e is not self.level]

    @property
    def num_own_past(self) -> int:
        return self.reused - (self.level.context_length if self.level is not None else 0)


class MlxRunner:
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
        self.kv_tree = kv_tree
        self.vocab_size = vocab_size
        self.prefill_step_size = prefill_step_size
        self.num_tokens_computed = 0
        self.adapters = MlxAdapters(model)
        self.layout = _probe_layout(model)
        self._split = compat.split_model(model)
        self.levels_enabled = compat.install_shared_attention(model)
        """Whether shared prefixes are read in place (else copied into every row)."""
        compat.clear_at_exit(self)

    @property
    def stats(self) -> RunnerStats:
        return RunnerStats(
            num_tokens_computed=self.num_tokens_computed, kv_cache_bytes=self.kv_tree.bytes_held
        )

    def request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget: the part of its context not cached yet (an estimate)."""
        cached = self.kv_tree.cached_length(request.context, request.adapter, request.parent)
        return max(1, len(request.context) - cached)

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Scores gathered from the rows of each continuation's prefixes (computed in one batch)."""
        return score_from_rows(self.run, requests)

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        """``[len(requests), vocab_size]`` float32 log-probabilities on the CPU."""
        out = torch.empty(len(requests), self.vocab_size, dtype=torch.float32)
        for adapter, positions in group_by_adapter(requests).items():
            with self.adapters.active(adapter):
                out[positions] = self.logprobs([requests[i].context for i in positions], adapter)
        return out

    def run_uncached(self, request: Request) -> torch.Tensor:
        """Reference: one plain mlx-lm forward over the whole context under its adapter, no cache."""
        with self.adapters.active(request.adapter):
            logits = self.model(mx.array([list(request.context)]))[:, -1]
            return _to_logprobs(logits, self.vocab_size)[0]

    def load_adapter(self, adapter: Adapter) -> None:
        self.adapters.load(adapter)

    def unload_adapter(self, adapter: Adapter) -> None:
        self.kv_tree.drop_namespace(adapter)
        self.adapters.unload(adapter)

    def clear(self) -> None:
        self.kv_tree.clear()
        mx.clear_cache()

    def close(self) -> None:
        self.clear()

    def logprobs(
        self, contexts: Sequence[tuple[int, ...]], namespace: Hashable = None
    ) -> torch.Tensor:
        """Log-probabilities after each context, keys/values kept under ``namespace``.

        Runs the model as it is (activating an adapter is :meth:`run`'s job).

        Returns:
            ``float32`` ``[len(contexts), vocab_size]`` on the CPU, normalized per row.
        """
        rows = self._plan(contexts, namespace)
        prefix = self._shared_uncached_prefix(rows, namespace)
        if prefix is not None:
            self._compute(self._plan([prefix], namespace), namespace)
            rows = self._plan(contexts, namespace)
        return self._compute(rows, namespace)

    def _plan(self, contexts: Sequence[tuple[int, ...]], namespace: Hashable) -> list[Row]:
        """Each context's cached part and its level: a cached prefix it shares with another row."""
        rows = []
        for index, context in enumerate(contexts):
            entry, shared = self.kv_tree.longest_prefix(context, namespace)
            reused = min(shared, len(context) - 1)  # the last token must run to give logits
            rows.append(Row(index, context, entry if reused > 0 else None, max(reused, 0)))
        if not self.levels_enabled:
            return rows
        roots = [_root(row) for row in rows]
        num_rows_of = Counter(id(root) for root in roots if root is not None)
        for row, root in zip(rows, roots):
            # A row alone behind a prefix copies it: a level saves nothing then, and
            # rows with levels of their own would each take a forward pass.
            if root is not None and num_rows_of[id(root)] > 1:
                row.level = root
        return rows

    def _shared_uncached_prefix(self, rows: list[Row], namespace: Hashable) -> tuple | None:
        """The prefix every context shares beyond its cached part, when long enough to compute once first."""
        if not self.levels_enabled or len(rows) < 2:
            return None
        contexts = [row.context for row in rows]
        length = _common_prefix_length(contexts)
        if length >= min(map(len, contexts)):
            return None
        prefix = contexts[0][:length]
        if length - self.kv_tree.cached_length(prefix, namespace) < MIN_LEVEL_TOKENS:
            return None
        return prefix

    def _compute(self, rows: list[Row], namespace: Hashable) -> torch.Tensor:
        out = torch.empty(len(rows), self.vocab_size, dtype=torch.float32)
        computed = []
        for group in _passes(rows):
            logprobs, block, own_start = self._forward(group)
            out[[row.index for row in group]] = logprobs
            computed.append((group, block, own_start))
        # Keys/values enter the tree only once every pass succeeded: a failed batch leaves nothing.
        for group, block, own_start in computed:
            placements = [
                Placement(
                    row.context,
                    i,
                    start,
                    row.level.context_length if row.level is not None else 0,
                    row.level,
                )
                for i, (row, start) in enumerate(zip(group, own_start))
            ]
            self.kv_tree.commit(block, placements, namespace)
        return out

    def _forward(self, rows: list[Row]) -> tuple[torch.Tensor, MlxKVBlock, list[int]]:
        """One pass over rows sharing a level: log-probabilities, the block written, each row's first slot."""
        num_new = max(row.num_new for row in rows)
        block, num_past, own_start = self._place(rows, num_new)
        # inputs: [B, num_new], each row's new tokens first, padding after them
        inputs = mx.array(
            [list(row.context[row.reused :]) + [0] * (num_new - row.num_new) for row in rows]
        )
        positions = mx.array([row.reused for row in rows], dtype=mx.int32)
        starts = mx.array(own_start, dtype=mx.int32)
        last = [row.num_new - 1 for row in rows]
        picked: list[mx.array] = []
        order: list[int] = []
        for begin in range(0, num_new, self.prefill_step_size):
            end = min(num_new, begin + self.prefill_step_size)
            forward = ForwardPass(
                block, num_past + begin, end - begin, positions + begin, starts, rows[0].level
            )
            out = self._call(inputs[:, begin:end], forward)  # [B, L, D] hidden, or [B, L, V] logits
            here = [i for i, j in enumerate(last) if begin <= j < end]
            if here:
                picked.append(out[mx.array(here), mx.array([last[i] - begin for i in here])])
                order.extend(here)
            mx.eval(picked, block.arrays())
            self._check_shared_reads(forward)
        selected = mx.concatenate(picked)[mx.array(np.argsort(order))]
        logits = selected if self._split is None else self._split[1](selected)
        self.num_tokens_computed += sum(row.num_new for row in rows)
        return _to_logprobs(logits, self.vocab_size), block, own_start

    def _place(self, rows: list[Row], num_new: int) -> tuple[MlxKVBlock, int, list[int]]:
        """The block the pass writes into, the slot its new tokens start at, and each row's first slot.

        One-token steps that extend a block's rows write into it in place;
        anything else gets a new block with each row's own past copied in.
        """
        block = self._extendable_block(rows) if num_new == 1 else None
        if block is not None:
            first = rows[0].entry
            assert first is not None  # an extendable block is its rows' entries'
            starts = [row.entry.start for row in rows if row.entry is not None]
            return block, first.start + first.length, starts  # every row's past ends there
        num_past = max(row.num_own_past for row in rows)
        block = self._block_with_pasts(rows, num_past, num_new)
        return block, num_past, [num_past - row.num_own_past for row in rows]

    def _call(self, inputs: mx.array, forward: ForwardPass) -> mx.array:
        if self._split is None:
            return self.model(inputs, cache=forward.views())
        return self._split[0](inputs, cache=forward.views())

    def _check_shared_reads(self, forward: ForwardPass) -> None:
        if forward.level is not None and forward.num_shared_reads != len(forward.block.keys):
            self.levels_enabled = False  # later batches copy shared prefixes into every row
            raise RuntimeError(
                f"{type(self.model).__module__}: only {forward.num_shared_reads} of "
                f"{len(forward.block.keys)} layers read the shared prefix through mlx-lm's "
                "scaled_dot_product_attention; this batch failed, later ones copy prefixes per row"
            )

    def _extendable_block(self, rows: list[Row]) -> MlxKVBlock | None:
        """The block every row extends by one token in place, if any (see :func:`~genlm_backend.cache.kv_block.extendable_block`)."""
        level = rows[0].level
        for row in rows:
            entry = row.entry
            if entry is None or entry is level or entry.parent is not level:
                return None
        block = extendable_block([(row.entry, row.reused) for row in rows])
        return block if isinstance(block, MlxKVBlock) else None

    def _block_with_pasts(self, rows: list[Row], num_past: int, num_new: int) -> MlxKVBlock:
        """A block of ``num_past + num_new`` slots (and spare ones) with each row's own past right-aligned at ``num_past``."""
        # One-token steps get spare slots, so the next steps can write in place.
        num_spare = max(8, num_past // 4) if num_new == 1 else 0
        num_slots = num_past + num_new + num_spare
        pinned = [entry for row in rows for entry, _ in row.own_pieces]
        pinned += [row.level for row in rows if row.level is not None]
        self.kv_tree.reserve(self.layout.nbytes(len(rows), num_slots), pinned=pinned)
        block = MlxKVBlock.zeros(self.layout, len(rows), num_slots)
        for i, row in enumerate(rows):
            slot = num_past - row.num_own_past
            for entry, length in row.own_pieces:
                for layer in range(self.layout.num_layers):
                    keys, values = span(entry, layer, length)
                    block.keys[layer][i, :, slot : slot + length] = keys
                    block.values[layer][i, :, slot : slot + length] = values
                slot += length
        return block


def _root(row: Row) -> KVEntry | None:
    """The first entry of the row's cached chain, if long enough to be a level and fully reused."""
    if row.entry is None:
        return None
    root = row.entry
    while root.parent is not None:
        root = root.parent
    if root.length < MIN_LEVEL_TOKENS or row.reused < root.context_length:
        return None
    return root


def _passes(rows: list[Row]) -> list[list[Row]]:
    """Rows grouped into forward passes: by shared level, one-token steps apart from longer ones.

    Longer computations are further split so that padding stays under half a pass.
    """
    groups: dict[tuple[bool, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.num_new == 1, id(row.level)), []).append(row)
    passes = []
    for (is_step, _), group in groups.items():
        if is_step:
            passes.append(group)
            continue
        group.sort(key=lambda row: -row.num_new)
        current: list[Row] = []
        for row in group:
            if current and 2 * row.num_new < current[0].num_new:
                passes.append(current)
                current = []
            current.append(row)
        passes.append(current)
    return passes


def _common_prefix_length(contexts: Sequence[tuple[int, ...]]) -> int:
    first = contexts[0]
    length = min(map(len, contexts))
    for context in contexts[1:]:
        i = 0
        while i < length and context[i] == first[i]:
            i += 1
        length = i
    return length


def _to_logprobs(logits: mx.array, vocab_size: int) -> torch.Tensor:
    """``[B, V_model]`` MLX logits -> ``[B, vocab_size]`` float32 torch log-probabilities on the CPU."""
    logits = logits.astype(mx.float32)
    mx.eval(logits)
    return fit_to_vocab(torch.from_numpy(np.array(logits, copy=True)), vocab_size)


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
