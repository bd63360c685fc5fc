"""Where each row's keys are, by fixed block and span, for one pass: :class:`ExactLayout`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from genlm_backend.cache import plan as planner
from genlm_backend.cache.plan import PassPlan
from genlm_backend.llm.hf.attention import Level
from genlm_backend.llm.hf.exact.numerics import (
    BLOCK_TOKENS,
    QUERY_CHUNK,
    SPAN_BLOCKS,
    SPAN_TOKENS,
    pad_rows,
)


@dataclass(frozen=True)
class ExactLayout:
    """Where each row's keys are, by fixed block, for one forward pass; made once, read by every layer.

    ``own_index[i, j]``: the slot in the pass's block of row ``i``'s own key
    ``j`` (its ``j``-th key after its levels), for ``NBo * b`` keys
    (padding points at the row's first slot and is masked).
    ``own_bias``: ``[B, 1, M, NBo * b]`` float32, ``0`` where query ``m`` (grouped
    heads, then new positions) sees the key, ``-inf`` where it does not.
    ``own_spans``: ``[B, NSo]``, the position-order span index of each
    row's own spans. ``levels``: each level with its first span.
    """

    own_index: torch.Tensor
    own_bias: torch.Tensor
    own_spans: torch.Tensor
    num_spans: int
    levels: tuple[tuple[Level, int], ...]
    covered: bool = False
    """Every row's every span is written by its own part or a level it reads (no zeros needed)."""
    own_only: bool = False
    """No levels, and every row's own spans are its spans ``0, 1, ...``: the spans of the
    own part's partial results are already in position order (merged where they are)."""
    rows_at: tuple[tuple[int, int, int, int], ...] = ()
    """Per row, on the host: the position of its first own key, its own keys, the position of
    its first query in this layout and its query count (how the CPU's span order plans a pass:
    :mod:`~genlm_backend.llm.hf.exact.spans`; empty for a captured step's layout)."""
    chunks: tuple[tuple[int, int, ExactLayout], ...] = ()
    """For a pass of more than :data:`QUERY_CHUNK` new positions: ``(first, end, layout)``
    of each run of positions, computed apart, each over the own keys it can see."""
    _rows: dict = field(default_factory=dict, compare=False, repr=False)

    def own_span_rows(self) -> torch.Tensor:
        """Where each row's own spans go among ``B * num_spans`` span rows, ``[B * NSo]``."""
        rows = self._rows.get("spans")
        if rows is None:
            spans = self.own_spans  # [B, NSo]
            first = torch.arange(spans.shape[0], device=spans.device)[:, None] * self.num_spans
            rows = self._rows["spans"] = (first + spans).flatten()
        return rows

    def own_rows(self, num_kv_heads: int, num_slots: int) -> torch.Tensor:
        """``own_index`` as rows of a ``[B * Hkv * S, D]`` view of the pass's keys, ``[B * Hkv * NBo * b]``
        (made once per pass: every layer gathers with it)."""
        key = (num_kv_heads, num_slots)
        rows = self._rows.get(key)
        if rows is None:
            num_rows = self.own_index.shape[0]
            heads = torch.arange(num_rows * num_kv_heads, device=self.own_index.device)
            rows = heads.view(num_rows, num_kv_heads, 1) * num_slots + self.own_index[:, None, :]
            rows = self._rows[key] = rows.flatten()
        return rows

    @classmethod
    def of(
        cls, plan: PassPlan, levels: Sequence[Level], num_groups: int, device: torch.device
    ) -> ExactLayout:
        b = BLOCK_TOKENS
        num_new = plan.num_new
        starts = [plan.num_past - row.num_own_past for row in plan.rows]
        splits = [row.split for row in plan.rows]
        own_lengths = [row.num_own_past + row.num_new for row in plan.rows]
        num_own_blocks = -(-max(own_lengths) // b)
        keys = torch.arange(num_own_blocks * b)
        lengths = torch.tensor(own_lengths)[:, None]
        index = torch.where(keys < lengths, torch.tensor(starts)[:, None] + keys, 0)
        index = torch.maximum(index, torch.tensor(starts)[:, None])
        # absolute positions: key j of row i at split_i + j, query t at reused_i + t
        key_at = torch.tensor(splits)[:, None] + keys  # [B, S]
        query_at = torch.tensor([row.reused for row in plan.rows])[:, None] + torch.arange(num_new)
        visible = (keys < lengths)[:, None, :] & (key_at[:, None, :] <= query_at[:, :, None])
        bias = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, -torch.inf)
        first_spans = torch.tensor(splits) // SPAN_TOKENS
        own_spans = first_spans[:, None] + torch.arange(-(-num_own_blocks // SPAN_BLOCKS))
        placed = []
        levels_end = 0  # the span after the last level's
        level_spans = []  # (first span, end span, reader rows)
        # levels come in the order of planner.level_readers; a level's first key is its entry's offset
        for level, ((entry, n), readers) in zip(
            levels, planner.level_readers(plan.rows), strict=True
        ):
            assert entry.offset % SPAN_TOKENS == 0 and n % SPAN_TOKENS == 0, (
                "levels span whole spans"
            )
            first, end = entry.offset // SPAN_TOKENS, (entry.offset + n) // SPAN_TOKENS
            placed.append((level, first))
            levels_end = max(levels_end, end)
            level_spans.append((first, end, readers))

        def is_covered(num_spans: int, num_own: int) -> bool:
            written = torch.zeros(len(plan.rows), num_spans, dtype=torch.bool)
            for i, first in enumerate(first_spans.tolist()):
                written[i, first : first + num_own] = True
            for first, end, readers in level_spans:
                written[readers, first:end] = True
            return bool(written.all())

        def layout(first: int, end: int, chunks=()) -> ExactLayout:
            # own key j is visible to position t only if j <= own past + t: later blocks are left out
            seen = -(-(max(row.num_own_past for row in plan.rows) + end) // b) * b
            seen = min(seen, num_own_blocks * b) if not chunks else num_own_blocks * b
            # spans past the last one seen would add exact zeros to the merge: left out too
            num_own = -(-seen // SPAN_TOKENS)
            num_spans = max(int(own_spans[:, num_own - 1].max()) + 1, levels_end)
            part = bias[:, None, first:end, :seen].expand(-1, num_groups, -1, -1)
            # queries as the products take them: grouped heads, then positions; padded to MIN_ROWS
            part = pad_rows(part.flatten(1, 2), dim=1)  # [B, M, S]
            return cls(
                own_index=index[:, :seen].to(device),
                own_bias=part[:, None].contiguous().to(device),
                own_spans=own_spans[:, :num_own].to(device),
                num_spans=num_spans,
                levels=tuple(placed),
                covered=not chunks and is_covered(num_spans, num_own),
                own_only=not placed and not first_spans.any() and num_spans == num_own,
                rows_at=tuple(
                    (split, length, row.reused + first, end - first)
                    for split, length, row in zip(splits, own_lengths, plan.rows, strict=True)
                ),
                chunks=chunks,
            )

        if num_new <= QUERY_CHUNK:
            return layout(0, num_new)
        chunks = tuple(
            (
                first,
                min(first + QUERY_CHUNK, num_new),
                layout(first, min(first + QUERY_CHUNK, num_new)),
            )
            for first in range(0, num_new, QUERY_CHUNK)
        )
        return layout(0, 0, chunks)  # gathers every own key once; the chunks compute

    @classmethod
    def of_step(
        cls,
        splits: torch.Tensor,
        firsts: torch.Tensor,
        writes: torch.Tensor,
        levels: Sequence[tuple[Level, int]],
        num_groups: int,
        num_slots: int,
    ) -> ExactLayout:
        """The layout of a captured one-token step, made on the device from the step's inputs.

        Row ``i``'s own part is slots ``[firsts[i], writes[i]]`` of the graph's
        storage (``num_slots`` slots), the context's tokens from ``splits[i]``
        on (a multiple of :data:`SPAN_TOKENS`: the tokens it reads as
        levels). Every level is read by every row, each weighing nothing for
        the rows its ``row_bias`` leaves out; ``levels`` pairs each with its
        first span. The shapes depend only on the graph, so they hold for
        every replay: the own part is gathered over all the storage's blocks
        (those past a row's last key add exact zeros to its merge), and the
        span buffers have room for any row's own spans after any level.
        """
        b = BLOCK_TOKENS
        num_own_blocks = -(-num_slots // b)
        keys = torch.arange(num_own_blocks * b, device=firsts.device)
        visible = keys <= (writes - firsts)[:, None]  # [R, S]
        index = torch.where(visible, firsts[:, None] + keys, firsts[:, None])
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=firsts.device)
        bias = bias.masked_fill_(~visible, -torch.inf)[:, None].expand(-1, num_groups, -1)
        num_own = -(-num_own_blocks // SPAN_BLOCKS)
        own_spans = (splits // SPAN_TOKENS)[:, None] + torch.arange(num_own, device=firsts.device)
        levels_end = max(
            (first + level.length // SPAN_TOKENS for level, first in levels), default=0
        )
        return cls(
            own_index=index,
            own_bias=pad_rows(bias, dim=1)[:, None].contiguous(),
            own_spans=own_spans,
            num_spans=levels_end + num_own,
            levels=tuple(levels),
            own_only=not levels,
        )
