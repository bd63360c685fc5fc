"""Exact attention on the CPU: spans of keys through torch's fused CPU attention kernel, merged
in a fixed tree.

torch's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``)
computes a block of queries against a block of keys with one score product,
an exact row maximum, a vectorized ``exp`` and sum, and one product with the
values. Handed a fixed number of keys per batch entry (one key block: nothing
is rescaled) and a multiple of :data:`QUERY_ROWS` queries (its query blocks of
32, 64 or 256 then never leave a tail of fewer than 16 rows, whose products
take another kernel), a query's output and log-sum-exp over those keys have
the same bits whatever else the call holds: how many queries, where the
query sits among them, how many batch entries, a mask of zeros or none, the
thread count (measured on torch 2.13, float32 and bfloat16, an AVX2 CPU:
``tests/test_exact_spans.py``).

A query at position ``p`` reads its context span by span
(:data:`~genlm_backend.llm.hf.exact.SPAN_TOKENS` keys at fixed positions):

* every span before the one holding ``p`` whole, in one batch entry of
  ``SPAN_TOKENS`` keys and no mask, wherever its keys are held: a level read
  by many rows (their queries go in together) or the row's own part;
* the span holding ``p`` in blocks of :data:`~genlm_backend.llm.hf.exact.BLOCK_TOKENS`
  keys, those past ``p`` masked (it is always in the row's own part: levels end
  at span boundaries before a row's first query), the blocks merged into the
  span.

Which entries a query reads depends only on ``p``; each entry's bits only on
the query and the keys. The entries then merge with weights ``exp(m - top)``,
``top`` the query's highest ``m`` (an exact maximum), summed in halves
(:func:`~genlm_backend.llm.hf.exact.sum_in_halves`), so that spans a query
does not reach add exact zeros. Another fixed order than
:func:`~genlm_backend.llm.hf.exact.exact_attention`'s, used for every pass on
the CPU; it reads the same :class:`~genlm_backend.llm.hf.exact.ExactLayout`,
planned on the host (:class:`SpanPlan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genlm_backend.llm.hf.exact.layout import ExactLayout
from genlm_backend.llm.hf.exact.numerics import (
    BLOCK_TOKENS,
    SPAN_BLOCKS,
    SPAN_TOKENS,
    exp_of_difference,
    sum_in_halves,
)
from genlm_backend.llm.hf.exact.torch_order import in_runs

QUERY_ROWS = 16
"""Queries of every call are a multiple of this many (padded with zeros)."""

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def padded_queries(num_queries: int) -> int:
    """The query count of a call holding ``num_queries``: the next multiple of :data:`QUERY_ROWS`."""
    return max(1, -(-num_queries // QUERY_ROWS)) * QUERY_ROWS


def _pad_queries(x: torch.Tensor, dim: int) -> torch.Tensor:
    size = x.shape[dim]
    padded = padded_queries(size)
    if padded == size:
        return x
    shape = list(x.shape)
    shape[dim] = padded - size
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


@dataclass(frozen=True)
class SpanPlan:
    """Where one layout's own parts go through the kernel, made on the host once per pass.

    The rows' own keys are gathered once, ``[B, W, Hkv, D]`` (keys leading);
    entries name runs of rows of its ``[B * W, Hkv, D]`` view.

    * ``unread``: the merge's rows (of ``[B * NS]``) of own spans past all of a row's queries.
    * Whole spans, before each row's last span holding a query: their rows of
      queries (``whole_rows``), first keys (``whole_keys``), merge rows (``whole_to``).
    * Blocks of the spans holding a row's queries (its *windows*): their rows of
      queries, first keys, ``mask`` ``[E, 1, Q, b]`` (``0`` or ``-inf``), ``hidden``
      ``[E, 1, Q]`` (a query that sees none of the block's keys) and place among
      ``N * SPAN_BLOCKS`` (``block_window``; ``None`` when every window has one block,
      its first, in window order).
    * Windows: their merge rows (``window_rows``), and for each query whether the
      window holds it (``in_blocks`` ``[N, 1, M]``) or lies before it
      (``whole_before``); both ``None`` when every window holds every query of its row.
    """

    unread: torch.Tensor
    whole_rows: torch.Tensor
    whole_keys: torch.Tensor
    whole_to: torch.Tensor
    block_rows: torch.Tensor
    block_keys: torch.Tensor
    mask: torch.Tensor
    hidden: torch.Tensor
    block_window: torch.Tensor | None
    first_blocks: bool
    """Every row has one block, its first own keys, in row order (the blocks are views)."""
    window_rows: torch.Tensor
    in_blocks: torch.Tensor | None
    whole_before: torch.Tensor | None

    @classmethod
    def of(cls, layout: ExactLayout, width: int, num_groups: int) -> SpanPlan:
        """The plan of ``layout``'s queries over own keys gathered ``width`` wide."""
        key = ("span plan", width, num_groups)
        made = layout._rows.get(key)
        if made is None:
            made = layout._rows[key] = cls._make(layout, width, num_groups)
        return made

    @classmethod
    def _make(cls, layout: ExactLayout, width: int, num_groups: int) -> SpanPlan:
        spans_at = layout.own_span_rows().view(len(layout.rows_at), -1).tolist()
        num_positions = layout.rows_at[0][3]
        unread, whole, whole_to = [], [], []
        block_rows: list[int] = []
        block_starts: list[int] = []
        block_window: list[int] = []
        windows: list[tuple[int, int]] = []
        first_positions = []
        for i, (split, length, first_query, num_queries) in enumerate(layout.rows_at):
            last_key = length - 1
            first_position = first_query - split  # of the row's first query among its own keys
            low = min(first_position, last_key) // SPAN_TOKENS
            last_position = min(first_position + num_queries - 1, last_key)
            high = last_position // SPAN_TOKENS
            unread += spans_at[i][high + 1 :]
            whole += [i * width + j * SPAN_TOKENS for j in range(high)]
            whole_to += spans_at[i][:high]
            first_positions.append(first_position)
            for span in range(low, high + 1):
                for start in range(span * SPAN_TOKENS, last_position + 1, BLOCK_TOKENS):
                    if start >= (span + 1) * SPAN_TOKENS:
                        break
                    block_rows.append(i)
                    block_starts.append(start)
                    block_window.append(
                        len(windows) * SPAN_BLOCKS + start // BLOCK_TOKENS % SPAN_BLOCKS
                    )
                windows.append((i, span))
        rows = torch.tensor(block_rows)
        starts = torch.tensor(block_starts)
        lengths = torch.tensor([length for _, length, _, _ in layout.rows_at])
        positions = torch.tensor(first_positions)[:, None] + torch.arange(num_positions)  # [B, L]
        keys = starts[:, None, None] + torch.arange(BLOCK_TOKENS)  # [E, 1, b]
        seen = (keys < lengths[rows, None, None]) & (keys <= positions[rows, :, None])  # [E, L, b]
        seen = _grouped(seen, num_groups, fill=True)  # [E, Q, b]
        mask = torch.zeros(seen.shape).masked_fill_(~seen, -torch.inf)[:, None]
        one_block = len(block_rows) == len(windows) and all(
            start % SPAN_TOKENS == 0 for start in block_starts
        )
        window_of = torch.tensor([i for i, _ in windows])
        spans = torch.minimum(positions, lengths[:, None] - 1) // SPAN_TOKENS  # each query's
        window_spans = torch.tensor([span for _, span in windows])[:, None]
        in_blocks = spans[window_of] == window_spans  # [N, L]
        selects = not bool(in_blocks.all())
        num_real = num_groups * num_positions
        return cls(
            unread=torch.tensor(unread, dtype=torch.long),
            whole_rows=torch.tensor([key // width for key in whole], dtype=torch.long),
            whole_keys=torch.tensor(whole, dtype=torch.long),
            whole_to=torch.tensor(whole_to, dtype=torch.long),
            block_rows=rows,
            block_keys=rows * width + starts,
            mask=mask,
            hidden=(~seen.any(-1))[:, None],
            block_window=None if one_block else torch.tensor(block_window),
            first_blocks=block_rows == list(range(len(layout.rows_at))) and not any(block_starts),
            window_rows=torch.tensor([spans_at[i][span] for i, span in windows]),
            in_blocks=_grouped(in_blocks, num_groups, False)[:, None, :num_real]
            if selects
            else None,
            whole_before=_grouped(spans[window_of] > window_spans, num_groups, False)[
                :, None, :num_real
            ]
            if selects
            else None,
        )


def _grouped(per_position: torch.Tensor, num_groups: int, fill: bool) -> torch.Tensor:
    """``[E, L, ...]`` per position to ``[E, Q, ...]`` per query (grouped heads, then positions),
    padded to :func:`padded_queries` with ``fill``."""
    num_entries, num_positions = per_position.shape[:2]
    out = per_position.repeat(1, num_groups, *([1] * (per_position.dim() - 2)))
    pad = padded_queries(num_groups * num_positions) - out.shape[1]
    if not pad:
        return out
    return torch.cat([out, out.new_full((num_entries, pad, *out.shape[2:]), fill)], dim=1)


def _gather_own(key: torch.Tensor, value: torch.Tensor, layout: ExactLayout):
    """The rows' own keys and values, ``[B, W, Hkv, D]`` (keys leading: a span or block of a
    row is a run of rows of its ``[B * W, Hkv, D]`` view)."""
    num_rows, num_kv_heads, num_slots, head_dim = key.shape
    index = layout.own_index  # [B, W]
    cached = ("keys leading", num_kv_heads, num_slots)
    rows = layout._rows.get(cached)
    if rows is None:
        heads = torch.arange(num_kv_heads, device=index.device)
        first = torch.arange(num_rows, device=index.device)[:, None, None] * num_kv_heads
        rows = layout._rows[cached] = ((first + heads) * num_slots + index[:, :, None]).flatten()
    shape = (num_rows, index.shape[1], num_kv_heads, head_dim)
    return (
        key.reshape(-1, head_dim).index_select(0, rows).view(shape),
        value.reshape(-1, head_dim).index_select(0, rows).view(shape),
    )


def _runs(keys: torch.Tensor, firsts: torch.Tensor, length: int) -> torch.Tensor:
    """Runs of ``length`` rows of ``keys`` (``[B, W, Hkv, D]``) from each of ``firsts`` (rows of its
    ``[B * W, ...]`` view), as ``[E, Hkv, length, D]``: a view when they tile one row in order."""
    num_rows, width, num_kv_heads, head_dim = keys.shape
    count = firsts.shape[0]
    if (
        num_rows == 1
        and count * length <= width
        and torch.equal(firsts, torch.arange(count) * length)
    ):
        return keys[0, : count * length].view(count, length, num_kv_heads, head_dim).transpose(1, 2)
    rows = (firsts[:, None] + torch.arange(length)).flatten()
    flat = keys.reshape(-1, num_kv_heads, head_dim).index_select(0, rows)
    return flat.view(count, length, num_kv_heads, head_dim).transpose(1, 2)


def _queries_of(queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``queries`` (``[B, Hkv, Q, D]``) of each entry's row, ``[E, Hkv, Q, D]`` (a view for one row)."""
    if queries.shape[0] == 1:
        return queries.expand(rows.shape[0], *queries.shape[1:])
    return queries.index_select(0, rows)


def span_exact_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    layout: ExactLayout,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Exact attention in the span order (arguments and result as
    :func:`~genlm_backend.llm.hf.exact.exact_attention`'s; ``own``: the rows' own keys and
    values gathered by the pass's layout, ``[B, W, Hkv, D]``, which its runs of positions read)."""
    if not layout.rows_at:
        raise ValueError(
            "the span order plans a pass on the host; a captured step's layout has no plan"
        )
    if layout.chunks:
        own = _gather_own(key, value, layout)
        return in_runs(
            query,
            layout,
            lambda run, part: span_exact_attention(layer, run, key, value, scale, part, own),
        )
    num_rows, num_kv_heads, _, head_dim = key.shape
    num_q_heads, num_new = query.shape[1], query.shape[2]
    num_groups = num_q_heads // num_kv_heads
    num_queries = num_groups * num_new  # grouped heads, then positions
    grouped = query.reshape(num_rows, num_kv_heads, num_queries, head_dim)
    padded = _pad_queries(grouped, dim=2)  # [B, Hkv, Q, D]
    own_keys, own_values = _gather_own(key, value, layout) if own is None else own
    plan = SpanPlan.of(layout, own_keys.shape[1], num_groups)

    # merge entries per row and span: m (log-scale), s (sum of weights at m), and the
    # weighted values, written once every m is known (each query's weights need its top)
    m, s, weighted = _span_buffers(
        query, (num_rows, layout.num_spans, num_kv_heads, num_queries), head_dim, layout
    )
    flat_m, flat_s = m.view(-1, num_kv_heads, num_queries), s.view(-1, num_kv_heads, num_queries)
    flat_weighted = weighted.view(-1, num_kv_heads, num_queries, head_dim)
    if plan.unread.numel():  # own spans past every query of the row
        flat_m.index_fill_(0, plan.unread, -torch.inf)
        flat_s.index_fill_(0, plan.unread, 0.0)
        flat_weighted.index_fill_(0, plan.unread, 0.0)
    whole_out = None
    if plan.whole_rows.numel():  # whole own spans, unmasked
        whole_out, lse = _flash(
            _queries_of(padded, plan.whole_rows),
            _runs(own_keys, plan.whole_keys, SPAN_TOKENS),
            _runs(own_values, plan.whole_keys, SPAN_TOKENS),
            0.0,
            False,
            scale=scale,
        )
        whole_out = whole_out[..., :num_queries, :]
        flat_m.index_copy_(0, plan.whole_to, lse[..., :num_queries])
        flat_s.index_fill_(0, plan.whole_to, 1.0)
    level_outs = []
    for level, first in layout.levels:
        level_keys, level_values = level.keys_values(layer)  # [1, Hkv, n, D]
        num_spans = level_keys.shape[2] // SPAN_TOKENS
        readers = padded if level.rows is None else padded.index_select(0, level.rows)
        num_readers = readers.shape[0]
        together = _pad_queries(readers[..., :num_queries, :].transpose(0, 1).flatten(1, 2), 1)
        out, lse = _flash(
            together[None].expand(num_spans, *together.shape),
            level_keys[0].unflatten(1, (num_spans, SPAN_TOKENS)).transpose(0, 1),
            level_values[0].unflatten(1, (num_spans, SPAN_TOKENS)).transpose(0, 1),
            0.0,
            False,
            scale=scale,
        )  # [ns, Hkv, Q', D], [ns, Hkv, Q']
        num_read = num_readers * num_queries
        lse = lse[..., :num_read].unflatten(2, (num_readers, num_queries)).permute(2, 0, 1, 3)
        out = out[..., :num_read, :].unflatten(2, (num_readers, num_queries))
        out = out.permute(2, 0, 1, 3, 4)
        if level.row_bias is not None:
            raise ValueError("the span order reads levels by the rows that read them")
        place = slice(first, first + num_spans)
        m[level.rows if level.rows is not None else slice(None), place] = lse
        s[level.rows if level.rows is not None else slice(None), place] = 1.0
        level_outs.append((level.rows, place, out))

    # the spans holding the queries, block by block, merged into each span
    if plan.first_blocks:
        block_queries = padded
        block_keys = own_keys[:, :BLOCK_TOKENS].transpose(1, 2)
        block_values = own_values[:, :BLOCK_TOKENS].transpose(1, 2)
    else:
        block_queries = _queries_of(padded, plan.block_rows)
        block_keys = _runs(own_keys, plan.block_keys, BLOCK_TOKENS)
        block_values = _runs(own_values, plan.block_keys, BLOCK_TOKENS)
    out, lse = _flash(
        block_queries,
        block_keys,
        block_values,
        0.0,
        False,
        attn_mask=plan.mask,
        scale=scale,
    )  # [E, Hkv, Q, D], [E, Hkv, Q]
    lse = lse.masked_fill(plan.hidden, -torch.inf)[..., :num_queries]
    out = out[..., :num_queries, :]
    window_o: torch.Tensor
    if plan.block_window is None:  # one block per window: the window is that block
        window_m, window_s, window_o = lse, torch.ones_like(lse), out
    else:
        num_windows = plan.window_rows.shape[0]
        shape = (num_windows * SPAN_BLOCKS, num_kv_heads, num_queries)
        block_m = lse.new_full(shape, -torch.inf).index_copy_(0, plan.block_window, lse)
        block_o = lse.new_zeros((*shape, head_dim)).index_copy_(0, plan.block_window, out.float())
        block_m = block_m.unflatten(0, (num_windows, SPAN_BLOCKS))
        block_o = block_o.unflatten(0, (num_windows, SPAN_BLOCKS))
        window_m = block_m.amax(1)  # [N, Hkv, M]
        top = torch.where(window_m == -torch.inf, 0.0, window_m)[:, None]
        weights = exp_of_difference(block_m, top)
        window_s = sum_in_halves(weights, 1)
        window_o = sum_in_halves(block_o * weights[..., None], 1, in_place=True)
    if layout.num_spans == 1:  # one window per row, every query in it: the merge is o / s
        if plan.block_window is None:
            return _as_output(out, query)
        return _as_output(window_o / torch.where(window_s > 0, window_s, 1.0)[..., None], query)
    at = plan.window_rows
    held, before = plan.in_blocks, plan.whole_before
    if held is not None and before is not None:
        # a window's span for each query: in blocks if it holds the query, whole if before it
        window_m = torch.where(
            held, window_m, torch.where(before, flat_m.index_select(0, at), -torch.inf)
        )
        window_s = torch.where(held, window_s, torch.where(before, flat_s.index_select(0, at), 0.0))
    flat_m.index_copy_(0, at, window_m)
    flat_s.index_copy_(0, at, window_s)

    # each query's weights exp(m - top), then every entry's values weighted, in place
    top = m.amax(1, keepdim=True)
    weights = exp_of_difference(m, torch.where(top == -torch.inf, 0.0, top))
    total = sum_in_halves(weights * s, 1)[..., None]
    flat_weights = weights.view(-1, num_kv_heads, num_queries, 1)
    if whole_out is not None:
        to = plan.whole_to
        flat_weighted.index_copy_(0, to, whole_out * flat_weights.index_select(0, to))
    for rows, place, out in level_outs:
        if rows is None:
            torch.mul(out, weights[:, place, ..., None], out=weighted[:, place])
        else:
            weighted[rows, place] = out * weights[rows, place][..., None]
    window_weighted = window_o * flat_weights.index_select(0, at)
    if held is not None and before is not None:
        window_weighted = torch.where(
            held[..., None],
            window_weighted,
            torch.where(before[..., None], flat_weighted.index_select(0, at), 0.0),
        )
    flat_weighted.index_copy_(0, at, window_weighted)
    summed = sum_in_halves(weighted, 1, in_place=True)
    return _as_output(summed / torch.where(total > 0, total, 1.0), query)


def _span_buffers(
    like: torch.Tensor, shape: tuple[int, ...], head_dim: int, layout: ExactLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 merge entries of every row's spans: scales and sums ``shape``, weighted values
    ``(*shape, head_dim)``; ``-inf`` and zeros where a row has spans no part writes (left unset
    when every span is written)."""
    if layout.covered:
        m = like.new_empty(shape, dtype=torch.float32)
        return m, torch.empty_like(m), m.new_empty((*shape, head_dim))
    m = like.new_full(shape, -torch.inf, dtype=torch.float32)
    return m, torch.zeros_like(m), m.new_zeros((*shape, head_dim))


def _as_output(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, M, D]`` per grouped query to ``[B, L, Hq, D]`` in ``query``'s dtype."""
    num_rows, num_q_heads, num_new, head_dim = query.shape
    out = out.reshape(num_rows, num_q_heads, num_new, head_dim).transpose(1, 2)
    return out.to(query.dtype)
