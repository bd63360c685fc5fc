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

from genlm_backend.llm.hf.exact import (
    BLOCK_TOKENS,
    SPAN_BLOCKS,
    SPAN_TOKENS,
    ExactLayout,
    exp_of_difference,
    sum_in_halves,
)

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
    entries name rows of it. ``whole``: the whole spans before each row's
    last span holding a query, as ``(row, first key)``; ``blocks``: the blocks
    of the spans holding its queries, with their ``mask`` ``[E, 1, Q, b]``
    (``0`` or ``-inf``) and ``hidden`` ``[E, 1, Q]`` (a query seeing none of the
    block's keys); ``unread``: the merge's rows of own spans past all of a row's
    queries; ``windows``: those spans, each ``(row, span)`` with where it
    goes among the merge's rows (``window_rows``), which of its queries read it in
    blocks (``in_blocks`` ``[N, 1, M]``: the span holds the query) or whole
    (``whole_before``: the span lies before the query's); ``block_window``: each
    block's place among ``N * SPAN_BLOCKS``.
    """

    unread: torch.Tensor
    whole_rows: torch.Tensor
    whole_keys: torch.Tensor
    whole_to: torch.Tensor
    block_rows: torch.Tensor
    block_keys: torch.Tensor
    mask: torch.Tensor
    hidden: torch.Tensor
    block_window: torch.Tensor
    window_rows: torch.Tensor
    in_blocks: torch.Tensor
    whole_before: torch.Tensor

    @classmethod
    def of(cls, layout: ExactLayout, width: int, num_groups: int) -> SpanPlan:
        """The plan of ``layout``'s queries over own keys gathered ``width`` wide."""
        key = ("span plan", width, num_groups)
        made = layout._rows.get(key)
        if made is not None:
            return made
        spans_at = layout.own_span_rows().view(len(layout.rows_at), -1)  # [B, NSo] merge rows
        unread = []  # merge rows of own spans past the row's queries
        whole = []  # (row, local span)
        blocks = []  # (row, first own key, window)
        windows = []  # (row, local span)
        block_masks, window_choice = [], []
        for i, (split, length, first_query, num_queries) in enumerate(layout.rows_at):
            last_key = max(length - 1, 0)
            positions = torch.arange(first_query, first_query + num_queries) - split
            spans = torch.clamp(positions, max=last_key) // SPAN_TOKENS  # each query's span
            low, high = int(spans.min()), int(spans.max())
            whole += [(i, j) for j in range(high)]
            unread += spans_at[i, high + 1 :].tolist()
            for span in range(low, high + 1):
                for k in range(SPAN_BLOCKS):
                    start = span * SPAN_TOKENS + k * BLOCK_TOKENS
                    if start > min(last_key, int(positions.max())):
                        break
                    keys = start + torch.arange(BLOCK_TOKENS)
                    seen = (keys < length) & (keys <= positions[:, None])  # [L, b]
                    block_masks.append(seen)
                    blocks.append((i, start, len(windows)))
                window_choice.append((spans == span, spans > span))
                windows.append((i, span))
        num_queries_padded = padded_queries(num_groups * layout.rows_at[0][3])

        def grouped(per_position: torch.Tensor, fill: bool) -> torch.Tensor:
            # [L, ...] per position -> [M', ...] per query (grouped heads, then positions), padded
            out = per_position.repeat(num_groups, *([1] * (per_position.dim() - 1)))
            pad = num_queries_padded - out.shape[0]
            return torch.cat([out, out.new_full((pad, *out.shape[1:]), fill)]) if pad else out

        seen = torch.stack([grouped(m, True) for m in block_masks])  # [E, Q, b]
        mask = torch.zeros(seen.shape, dtype=torch.float32).masked_fill_(~seen, -torch.inf)
        num_real = num_groups * layout.rows_at[0][3]
        made = cls(
            unread=torch.tensor(unread, dtype=torch.long),
            whole_rows=torch.tensor([i for i, _ in whole], dtype=torch.long),
            whole_keys=torch.tensor(
                [i * width + j * SPAN_TOKENS for i, j in whole], dtype=torch.long
            ),
            whole_to=torch.tensor([int(spans_at[i, j]) for i, j in whole], dtype=torch.long),
            block_rows=torch.tensor([i for i, _, _ in blocks], dtype=torch.long),
            block_keys=torch.tensor([i * width + start for i, start, _ in blocks]),
            mask=mask[:, None],
            hidden=(~seen.any(-1))[:, None],
            block_window=torch.tensor(
                [w * SPAN_BLOCKS + (start % SPAN_TOKENS) // BLOCK_TOKENS for _, start, w in blocks]
            ),
            window_rows=torch.tensor([int(spans_at[i, j]) for i, j in windows]),
            in_blocks=torch.stack([grouped(a, False)[:num_real] for a, _ in window_choice])[
                :, None
            ],
            whole_before=torch.stack([grouped(b, False)[:num_real] for _, b in window_choice])[
                :, None
            ],
        )
        layout._rows[key] = made
        return made


def _gather_own(key: torch.Tensor, value: torch.Tensor, layout: ExactLayout):
    """The rows' own keys and values, ``[B, W, Hkv, D]`` (keys leading: a span or block of a
    row is a run of rows of its ``[B * W, Hkv, D]`` view)."""
    num_rows, num_kv_heads, num_slots, head_dim = key.shape
    index = layout.own_index  # [B, W]
    rows = layout._rows.get("keys leading")
    if rows is None:
        heads = torch.arange(num_kv_heads, device=index.device)
        first = torch.arange(num_rows, device=index.device)[:, None, None] * num_kv_heads
        rows = layout._rows["keys leading"] = ((first + heads) * num_slots + index[:, :, None]).flatten()
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
    if num_rows == 1 and count * length <= width and torch.equal(
        firsts, torch.arange(count) * length
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
        raise ValueError("the span order plans a pass on the host; a captured step's layout has no plan")
    if layout.chunks:
        own = _gather_own(key, value, layout)
        return torch.cat(
            [
                span_exact_attention(layer, query[:, :, first:end], key, value, scale, part, own)
                for first, end, part in layout.chunks
            ],
            dim=1,
        )
    num_rows, num_kv_heads, _, head_dim = key.shape
    num_q_heads, num_new = query.shape[1], query.shape[2]
    num_groups = num_q_heads // num_kv_heads
    num_queries = num_groups * num_new  # grouped heads, then positions
    grouped = query.reshape(num_rows, num_kv_heads, num_queries, head_dim)
    padded = _pad_queries(grouped, dim=2)  # [B, Hkv, Q, D]
    own_keys, own_values = _gather_own(key, value, layout) if own is None else own
    plan = SpanPlan.of(layout, own_keys.shape[1], num_groups)

    # merge entries per row and span: m (log-scale), s (sum of weights at m), o (weighted values)
    m, s, o = _span_buffers(
        query, (num_rows, layout.num_spans, num_kv_heads, num_queries), head_dim, layout
    )
    flat_m, flat_s = m.view(-1, num_kv_heads, num_queries), s.view(-1, num_kv_heads, num_queries)
    flat_o = o.view(-1, num_kv_heads, num_queries, head_dim)

    def put(to: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
        flat_m.index_copy_(0, to, lse[..., :num_queries])
        flat_s.index_fill_(0, to, 1.0)
        flat_o.index_copy_(0, to, out[..., :num_queries, :].float())

    if plan.unread.numel():  # own spans past every query of the row
        flat_m.index_fill_(0, plan.unread, -torch.inf)
        flat_s.index_fill_(0, plan.unread, 0.0)
        flat_o.index_fill_(0, plan.unread, 0.0)
    if plan.whole_rows.numel():  # whole own spans, unmasked
        out, lse = _flash(
            _queries_of(padded, plan.whole_rows),
            _runs(own_keys, plan.whole_keys, SPAN_TOKENS),
            _runs(own_values, plan.whole_keys, SPAN_TOKENS),
            0.0,
            False,
            scale=scale,
        )
        put(plan.whole_to, lse, out)
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
        total = num_readers * num_queries
        lse = lse[..., :total].unflatten(2, (num_readers, num_queries)).permute(2, 0, 1, 3)
        out = out[..., :total, :].unflatten(2, (num_readers, num_queries)).permute(2, 0, 1, 3, 4)
        rows = torch.arange(num_rows) if level.rows is None else level.rows.cpu()
        to = (rows[:, None] * layout.num_spans + first + torch.arange(num_spans)).flatten()
        if level.row_bias is not None:
            raise ValueError("the span order reads levels by the rows that read them")
        put(to.to(m.device), lse.flatten(0, 1), out.flatten(0, 1))

    # the spans holding the queries, block by block, merged into each span
    out, lse = _flash(
        _queries_of(padded, plan.block_rows),
        _runs(own_keys, plan.block_keys, BLOCK_TOKENS),
        _runs(own_values, plan.block_keys, BLOCK_TOKENS),
        0.0,
        False,
        attn_mask=plan.mask,
        scale=scale,
    )  # [E, Hkv, Q, D], [E, Hkv, Q]
    lse = lse.masked_fill(plan.hidden, -torch.inf)[..., :num_queries]
    num_windows = plan.window_rows.shape[0]
    block_m = lse.new_full((num_windows * SPAN_BLOCKS, num_kv_heads, num_queries), -torch.inf)
    block_o = lse.new_zeros((num_windows * SPAN_BLOCKS, num_kv_heads, num_queries, head_dim))
    block_m.index_copy_(0, plan.block_window, lse)
    block_o.index_copy_(0, plan.block_window, out[..., :num_queries, :].float())
    block_m = block_m.unflatten(0, (num_windows, SPAN_BLOCKS))
    block_o = block_o.unflatten(0, (num_windows, SPAN_BLOCKS))
    top = block_m.amax(1)  # [N, Hkv, M]
    weights = exp_of_difference(block_m, torch.where(top == -torch.inf, 0.0, top)[:, None])
    window_s = sum_in_halves(weights, 1)
    window_o = sum_in_halves(block_o * weights[..., None], 1)
    # a window's span for each query: in blocks if it holds the query, whole if before it, else nothing
    at = plan.window_rows
    before = plan.whole_before
    window_m = torch.where(
        plan.in_blocks, top, torch.where(before, flat_m.index_select(0, at), -torch.inf)
    )
    window_s = torch.where(
        plan.in_blocks, window_s, torch.where(before, flat_s.index_select(0, at), 0.0)
    )
    window_o = torch.where(
        plan.in_blocks[..., None],
        window_o,
        torch.where(before[..., None], flat_o.index_select(0, at), 0.0),
    )
    flat_m.index_copy_(0, at, window_m)
    flat_s.index_copy_(0, at, window_s)
    flat_o.index_copy_(0, at, window_o)
    return _merge(m, s, o, query)


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


def _merge(m: torch.Tensor, s: torch.Tensor, o: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Each query's spans merged: ``[B, NS, Hkv, M]`` scales and sums, ``[B, NS, Hkv, M, D]``
    weighted values, to ``[B, L, Hq, D]`` in ``query``'s dtype."""
    top = m.amax(1, keepdim=True)
    weights = exp_of_difference(m, torch.where(top == -torch.inf, 0.0, top))
    total = sum_in_halves(weights * s, 1)[..., None]
    out = sum_in_halves(o * weights[..., None], 1) / torch.where(total > 0, total, 1.0)
    num_rows, num_q_heads, num_new, head_dim = query.shape
    out = out.view(num_rows, num_q_heads, num_new, head_dim).transpose(1, 2)
    return out.to(query.dtype)
