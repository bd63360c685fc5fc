"""Exact attention in torch operations: every query's keys in fixed blocks, weighted by
``exp(score - top)``, summed span by span in a fixed tree (the order used on CUDA where the
fused kernels do not run)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from genlm_backend.llm.hf.exact.layout import ExactLayout
from genlm_backend.llm.hf.exact.numerics import (
    BLOCK_TOKENS,
    exp_of_difference,
    pad_rows,
    span_sums,
    sum_in_halves,
)


def _own_blocks(
    key: torch.Tensor, value: torch.Tensor, layout: ExactLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' own keys and values gathered from their slots, ``[B, Hkv, NBo * b, D]``."""
    num_rows, num_kv_heads, num_slots, head_dim = key.shape
    rows = layout.own_rows(num_kv_heads, num_slots)
    shape = (num_rows, num_kv_heads, -1, head_dim)
    return (
        key.reshape(-1, head_dim).index_select(0, rows).view(shape),
        value.reshape(-1, head_dim).index_select(0, rows).view(shape),
    )


def _scores(queries: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Float32 ``queries @ keys^T (+ bias)``, ``[..., M, n]``: one product over every key (a
    score's bits do not depend on how many keys the product has)."""
    scores = (queries @ keys.transpose(-1, -2)).float()
    return scores if bias is None else scores + bias


def _block_partials(
    scores: torch.Tensor, values: torch.Tensor, top: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each key block's sum of weights and weighted values, per query, weights ``exp(score - top)``.

    ``scores``: ``[..., M, n]`` (:func:`_scores`), ``n`` a multiple of
    :data:`BLOCK_TOKENS`; ``values``: ``[..., n, D]``; ``top``: ``[..., M]``,
    each query's highest score over all the keys it sees, wherever they are
    held (an exact maximum, whatever the order). Returns float32
    ``[..., nb, M]`` and ``[..., nb, M, D]``; a block with no visible key
    gives zeros. The weighted values come from one product per block (the
    sum over a block's keys must not depend on the others).
    """
    b = BLOCK_TOKENS
    blocks = scores.unflatten(-1, (-1, b)).transpose(-3, -2)  # [..., nb, M, b]
    weights = exp_of_difference(blocks, top[..., None, :, None])
    # The product's operands in one memory layout whatever their source (a level's view,
    # gathered own values): torch's bfloat16 products sum in another order otherwise.
    cast = weights.to(values.dtype)
    if values.dim() == 3 and not values.is_contiguous():  # a level: each head's slots are
        out = cast.new_empty(*cast.shape[:-1], values.shape[-1])  # contiguous, no copy
        for head in range(values.shape[0]):
            torch.matmul(cast[head], values[head].unflatten(0, (-1, b)), out=out[head])
    else:
        out = cast @ values.contiguous().unflatten(-2, (-1, b))  # [..., nb, M, D]
    return weights.sum(-1), out.float()


def _span_buffer(like: torch.Tensor, shape: tuple[int, ...], layout: ExactLayout) -> torch.Tensor:
    """Float32 partial results of every row's spans: zeros where a row has spans no part writes."""
    if layout.covered:
        return like.new_empty(shape, dtype=torch.float32)
    return like.new_zeros(shape, dtype=torch.float32)


def in_runs(
    query: torch.Tensor,
    layout: ExactLayout,
    compute: Callable[[torch.Tensor, ExactLayout], torch.Tensor],
) -> torch.Tensor:
    """A long pass's attention run by run of positions (``layout.chunks``): ``compute`` of each
    run's queries (``[B, Hq, l, D]``) and layout, concatenated along positions (``[B, L, Hq, D]``)."""
    return torch.cat(
        [compute(query[:, :, first:end], part) for first, end, part in layout.chunks], dim=1
    )


def exact_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    layout: ExactLayout,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention whose result for a query depends only on that query and its context's keys.

    Every score is computed first, wherever its key is held (the row's own
    part, levels shared with other rows), so that each query's weights are
    ``exp(score - top)`` with ``top`` its highest score over its whole context;
    then each block's weighted values, merged over blocks in a fixed tree.

    Args:
        layer: Index of the attention layer (which of each level's tensors to read).
        query: ``[B, Hq, L, D]``.
        key: The pass's block of keys, ``[B, Hkv, S, D]`` (rows' own parts and new keys).
        value: Likewise, the values.
        layout: The pass's :class:`ExactLayout`.
        own: The rows' own keys and values as blocks, ``[B, Hkv, S', D]`` (gathered here
            when ``None``); a run of positions reads the first blocks.

    Returns:
        ``[B, L, Hq, D]`` in ``query``'s dtype, the layout transformers' attention functions return.
    """
    if layout.chunks:
        own = _own_blocks(key, value, layout)
        return in_runs(
            query,
            layout,
            lambda run, part: exact_attention(layer, run, key, value, scale, part, own),
        )
    num_rows, num_q_heads, num_new, head_dim = query.shape
    num_kv_heads = key.shape[1]
    num_queries = (
        num_q_heads // num_kv_heads * num_new
    )  # per key/value head: grouped, then positions
    num_spans = layout.num_spans
    grouped = query.reshape(num_rows, num_kv_heads, num_queries, head_dim) * scale
    padded = pad_rows(grouped)  # [B, Hkv, M, D]

    # every score first: the rows' own keys (gathered into whole blocks), then each level's,
    # read once for all the rows that read it (their queries go in together)
    own_keys, own_values = _own_blocks(key, value, layout) if own is None else own
    seen = layout.own_index.shape[1]
    own_scores = _scores(padded, own_keys[:, :, :seen], layout.own_bias)  # [B, Hkv, M', S']
    top = own_scores[:, :, :num_queries].amax(-1)  # [B, Hkv, M]
    shared = []
    for level, first in layout.levels:
        level_keys, level_values = level.keys_values(layer)  # [1, Hkv, n, D]
        readers = grouped if level.rows is None else grouped.index_select(0, level.rows)
        num_readers = readers.shape[0]
        together = pad_rows(readers.transpose(0, 1).flatten(1, 2))  # [Hkv, R * M', D]
        scores = _scores(together, level_keys[0], None)
        level_top = scores[:, : num_readers * num_queries].amax(-1)  # [Hkv, R * M]
        level_top = level_top.unflatten(1, (num_readers, num_queries)).transpose(0, 1)
        left_out = None
        if level.row_bias is not None:  # every row reads it: those left out ignore its scores
            left_out = (level.row_bias != 0)[:, None, None]  # [R, 1, 1]
            level_top = level_top.masked_fill(left_out, -torch.inf)
        if level.rows is None:
            top = torch.maximum(top, level_top)
        else:
            top.index_copy_(
                0, level.rows, torch.maximum(top.index_select(0, level.rows), level_top)
            )
        shared.append((level, first, num_readers, scores, level_values[0], left_out))
    top = torch.where(top == -torch.inf, 0.0, top)  # a query that sees no key (padding) gets zeros
    s, o = _block_partials(own_scores, own_values[:, :, :seen], pad_rows(top, dim=-1))
    # [B, Hkv, NSo, M] and [B, Hkv, NSo, M, D]: each own span's sums
    s = span_sums(s[..., :num_queries], 2)
    o = span_sums(o[..., :num_queries, :], 2)
    if layout.own_only:  # the merge below, over the same spans in order
        total = sum_in_halves(s, 2)[..., None]
        out = sum_in_halves(o, 2) / torch.where(total > 0, total, 1.0)
        out = out.view(num_rows, num_q_heads, num_new, head_dim).transpose(1, 2)
        return out.to(query.dtype)

    # each span's partial results, spans leading: [B, NS, Hkv, M] and [B, NS, Hkv, M, D]
    span_sum = _span_buffer(query, (num_rows, num_spans, num_kv_heads, num_queries), layout)
    span_out = _span_buffer(
        query, (num_rows, num_spans, num_kv_heads, num_queries, head_dim), layout
    )
    # [B, Hkv, NSo, M, ...] -> rows of [B * NS, Hkv, M, ...] at each row's own spans
    at = layout.own_span_rows()
    flat = (num_rows * num_spans, num_kv_heads, num_queries)
    span_sum.view(flat).index_copy_(0, at, s.transpose(1, 2).flatten(0, 1))
    span_out.view(*flat, head_dim).index_copy_(0, at, o.transpose(1, 2).flatten(0, 1))
    for level, first, num_readers, scores, values, left_out in shared:
        readers_top = top if level.rows is None else top.index_select(0, level.rows)
        if left_out is not None:  # weights exp(score - inf): exact zeros
            readers_top = readers_top.masked_fill(left_out, torch.inf)
        together_top = pad_rows(readers_top.transpose(0, 1).flatten(1, 2), dim=-1)  # [Hkv, R * M']
        s, o = _block_partials(scores, values, together_top)
        # [Hkv, nb, R * M, ...] -> its spans, [Hkv, ns, R * M, ...] -> [R, ns, Hkv, M, ...]
        s = span_sums(s[:, :, : num_readers * num_queries], 1)
        o = span_sums(o[:, :, : num_readers * num_queries], 1)
        s = s.unflatten(2, (num_readers, num_queries)).permute(2, 1, 0, 3)
        o = o.unflatten(2, (num_readers, num_queries)).permute(2, 1, 0, 3, 4)
        spans = slice(first, first + s.shape[1])
        if level.row_bias is not None:  # zeros for the rows left out: added to their own spans
            span_sum[:, spans] += s
            span_out[:, spans] += o
            continue
        rows = slice(None) if level.rows is None else level.rows
        span_sum[rows, spans] = s
        span_out[rows, spans] = o

    # merge: spans past a query's keys add exact zeros, and sums do not group by the span count
    total = sum_in_halves(span_sum, 1)[..., None]
    out = sum_in_halves(span_out, 1) / torch.where(total > 0, total, 1.0)
    # [B, Hkv, g * L, D] -> [B, L, Hq, D]
    out = out.view(num_rows, num_q_heads, num_new, head_dim).transpose(1, 2)
    return out.to(query.dtype)
