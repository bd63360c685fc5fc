"""Exact attention on the CPU: each span of keys through torch's fused CPU attention kernel, the
spans merged in a fixed tree.

torch's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``)
computes a block of queries against a block of keys with one score product,
an exact row maximum, a vectorized ``exp`` and sum, and one product with the
values. Handed exactly :data:`~genlm_backend.llm.hf.exact.SPAN_TOKENS` keys per
batch entry (one key block: nothing is rescaled) and a multiple of
:data:`QUERY_ROWS` queries (its query blocks of 32, 64 or 256 then never leave
a tail of fewer than 16 rows, whose products take another kernel), a query's
output and log-sum-exp over the span have the same bits whatever else the
call holds: how many queries, where the query sits among them, how many
batch entries, a mask of zeros or none, the thread count (measured on torch
2.13, float32 and bfloat16, an AVX2 CPU: ``tests/test_exact_spans.py``).

So every span of a query's context is one batch entry of one call, wherever
its keys are held: a level read by many rows (their queries go in together),
or the row's own part (gathered into whole spans, the keys it does not see
masked). A query's spans then merge with weights ``exp(lse - top)``, ``top``
its highest log-sum-exp (an exact maximum), summed in halves
(:func:`~genlm_backend.llm.hf.exact.sum_in_halves`), so that spans a query
does not reach add exact zeros. Another fixed order than
:func:`~genlm_backend.llm.hf.exact.exact_attention`'s, used for every pass on
the CPU; it reads the same :class:`~genlm_backend.llm.hf.exact.ExactLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genlm_backend.llm.hf.exact import (
    SPAN_TOKENS,
    ExactLayout,
    exp_of_difference,
    sum_in_halves,
)

QUERY_ROWS = 16
"""Queries of every call are a multiple of this many (padded with zeros)."""

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _pad_to_multiple(x: torch.Tensor, dim: int, value: float = 0.0) -> torch.Tensor:
    size = x.shape[dim]
    padded = -(-size // QUERY_ROWS) * QUERY_ROWS
    if padded == size:
        return x
    shape = list(x.shape)
    shape[dim] = padded - size
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


@dataclass(frozen=True)
class OwnSpans:
    """The rows' own parts in whole spans, made once per pass (every layer reads them).

    ``rows``: for a ``[B * Hkv * S, D]`` view of the pass's keys, the rows that
    gather each row's own keys span by span, ``[B * NSo * SPAN_TOKENS * Hkv]``
    (keys leading, heads inner: a batch entry per row and span without a copy).
    ``bias``: ``[B * NSo, 1, Q, SPAN_TOKENS]`` float32 (``Q`` the queries padded to
    :data:`QUERY_ROWS`), ``0`` where a query sees the key, ``-inf`` where not; ``None``
    where every query sees every key. ``hidden``: ``[B, NSo, 1, Q]``, a query that
    sees no key of the span (its log-sum-exp there is set to ``-inf``); ``None`` if none.
    """

    rows: torch.Tensor
    num_spans: int
    bias: torch.Tensor | None
    hidden: torch.Tensor | None

    @classmethod
    def of(cls, layout: ExactLayout, num_kv_heads: int, num_slots: int) -> OwnSpans:
        key = ("spans", num_kv_heads, num_slots)
        made = layout._rows.get(key)
        if made is not None:
            return made
        index = layout.own_index  # [B, seen]
        num_rows, seen = index.shape
        num_spans = -(-seen // SPAN_TOKENS)
        width = num_spans * SPAN_TOKENS
        if width > seen:  # padding keys: the row's first slot, masked
            index = torch.cat([index, index[:, :1].expand(num_rows, width - seen)], dim=1)
        heads = torch.arange(num_kv_heads, device=index.device)
        first = torch.arange(num_rows, device=index.device)[:, None, None] * num_kv_heads
        rows = ((first + heads) * num_slots + index[:, :, None]).flatten()  # [B, width, Hkv]
        bias = layout.own_bias[:, 0]  # [B, M', seen]
        if width > seen:
            bias = torch.nn.functional.pad(bias, (0, width - seen), value=-torch.inf)
        bias = _pad_to_multiple(bias, dim=1)  # [B, Q, width]
        num_queries = bias.shape[1]
        bias = bias.view(num_rows, num_queries, num_spans, SPAN_TOKENS).transpose(1, 2)
        hidden = (bias == -torch.inf).all(-1)  # [B, NSo, Q]
        made = cls(
            rows=rows,
            num_spans=num_spans,
            bias=bias.reshape(num_rows * num_spans, 1, num_queries, SPAN_TOKENS),
            hidden=hidden[:, :, None],
        )
        layout._rows[key] = made
        return made


def _gather_own(key: torch.Tensor, value: torch.Tensor, spans: OwnSpans):
    """The rows' own keys and values as ``[B, NSo, Hkv, SPAN_TOKENS, D]`` views of one gather each."""
    num_rows, num_kv_heads, _, head_dim = key.shape
    shape = (num_rows, spans.num_spans, SPAN_TOKENS, num_kv_heads, head_dim)

    def gather(x):
        return x.reshape(-1, head_dim).index_select(0, spans.rows).view(shape).transpose(2, 3)

    return gather(key), gather(value)


def _per_span(queries: torch.Tensor, num_spans: int) -> torch.Tensor:
    """``[B, Hkv, Q, D]`` queries once per span, ``[B * num_spans, Hkv, Q, D]`` (a view when it can be)."""
    num_rows = queries.shape[0]
    spread = queries[:, None].expand(num_rows, num_spans, *queries.shape[1:])
    return spread.flatten(0, 1) if num_rows == 1 or num_spans == 1 else spread.reshape(
        num_rows * num_spans, *queries.shape[1:]
    )


def span_exact_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    layout: ExactLayout,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Exact attention, span by span in torch's CPU attention kernel (arguments and result as
    :func:`~genlm_backend.llm.hf.exact.exact_attention`'s; ``own``: the rows' own keys and values
    as spans, ``[B, NSo, Hkv, SPAN_TOKENS, D]``, of which a run of positions reads the first)."""
    num_rows, num_kv_heads, num_slots, head_dim = key.shape
    if layout.chunks:
        own = _gather_own(key, value, OwnSpans.of(layout, num_kv_heads, num_slots))
        return torch.cat(
            [
                span_exact_attention(layer, query[:, :, first:end], key, value, scale, part, own)
                for first, end, part in layout.chunks
            ],
            dim=1,
        )
    num_q_heads, num_new = query.shape[1], query.shape[2]
    num_queries = num_q_heads // num_kv_heads * num_new  # grouped heads, then positions
    grouped = query.reshape(num_rows, num_kv_heads, num_queries, head_dim)
    spans = OwnSpans.of(layout, num_kv_heads, num_slots)
    own_keys, own_values = _gather_own(key, value, spans) if own is None else own
    num_own = spans.num_spans
    own_keys, own_values = own_keys[:, :num_own].flatten(0, 1), own_values[:, :num_own].flatten(0, 1)
    queries = _per_span(_pad_to_multiple(grouped, dim=2), num_own)
    out, lse = _flash(queries, own_keys, own_values, 0.0, False, attn_mask=spans.bias, scale=scale)
    out = out.unflatten(0, (num_rows, num_own))[..., :num_queries, :]  # [B, NSo, Hkv, M, D]
    lse = lse.unflatten(0, (num_rows, num_own))  # [B, NSo, Hkv, Q]
    if spans.hidden is not None:
        lse = lse.masked_fill(spans.hidden, -torch.inf)
    lse = lse[..., :num_queries]
    if layout.own_only:  # the own spans are every row's spans, in order
        return _merge(lse, out, query)

    num_spans = layout.num_spans
    span_lse, span_out = _span_buffers(
        lse, (num_rows, num_spans, num_kv_heads, num_queries), head_dim, layout
    )
    at = layout.own_span_rows()
    span_lse.view(-1, num_kv_heads, num_queries).index_copy_(0, at, lse.flatten(0, 1))
    span_out.view(-1, num_kv_heads, num_queries, head_dim).index_copy_(
        0, at, out.flatten(0, 1).float()
    )
    for level, first in layout.levels:
        level_keys, level_values = level.keys_values(layer)  # [1, Hkv, n, D]
        level_spans = level_keys.shape[2] // SPAN_TOKENS
        readers = grouped if level.rows is None else grouped.index_select(0, level.rows)
        num_readers = readers.shape[0]
        together = _pad_to_multiple(readers.transpose(0, 1).flatten(1, 2), dim=1)  # [Hkv, Q, D]
        keys = level_keys[0].unflatten(1, (level_spans, SPAN_TOKENS)).transpose(0, 1)
        values = level_values[0].unflatten(1, (level_spans, SPAN_TOKENS)).transpose(0, 1)
        level_out, level_lse = _flash(
            together[None].expand(level_spans, *together.shape), keys, values, 0.0, False,
            scale=scale,
        )  # [ns, Hkv, Q, D], [ns, Hkv, Q]
        level_total = num_readers * num_queries
        level_lse = level_lse[..., :level_total].unflatten(2, (num_readers, num_queries))
        level_out = level_out[..., :level_total, :].unflatten(2, (num_readers, num_queries))
        level_lse = level_lse.permute(2, 0, 1, 3)  # [R, ns, Hkv, M]
        level_out = level_out.permute(2, 0, 1, 3, 4).float()  # [R, ns, Hkv, M, D]
        place = slice(first, first + level_spans)
        if level.row_bias is not None:  # every row reads it; those left out keep their spans
            left_out = (level.row_bias != 0)[:, None, None, None]
            span_lse[:, place] = torch.where(left_out, span_lse[:, place], level_lse)
            span_out[:, place] = torch.where(left_out[..., None], span_out[:, place], level_out)
            continue
        rows = slice(None) if level.rows is None else level.rows
        span_lse[rows, place] = level_lse
        span_out[rows, place] = level_out
    return _merge(span_lse, span_out, query)


def _span_buffers(
    like: torch.Tensor, shape: tuple[int, ...], head_dim: int, layout: ExactLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 log-sum-exps ``shape`` and outputs ``(*shape, head_dim)`` of every row's spans:
    ``-inf`` and zeros where a row has spans no part writes (left unset if every span is written)."""
    if layout.covered:
        return like.new_empty(shape), like.new_empty((*shape, head_dim))
    return like.new_full(shape, -torch.inf), like.new_zeros((*shape, head_dim))


def _merge(span_lse: torch.Tensor, span_out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """A query's spans merged: ``[B, NS, Hkv, M]`` log-sum-exps and ``[B, NS, Hkv, M, D]``
    normalized outputs to ``[B, L, Hq, D]`` in ``query``'s dtype."""
    top = span_lse.amax(1, keepdim=True)
    top = torch.where(top == -torch.inf, 0.0, top)  # a query that sees no key (padding): zeros
    weights = exp_of_difference(span_lse, top)  # spans it does not reach: exact zeros
    total = sum_in_halves(weights, 1)[..., None]
    out = sum_in_halves(span_out * weights[..., None], 1) / torch.where(total > 0, total, 1.0)
    num_rows, num_q_heads, num_new, head_dim = query.shape
    out = out.view(num_rows, num_q_heads, num_new, head_dim).transpose(1, 2)
    return out.to(query.dtype)
