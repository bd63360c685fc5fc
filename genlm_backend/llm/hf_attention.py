"""Attention for the HF runner: shared cached prefixes read once per batch, grouped heads never repeated.

A batch row's keys/values are the concatenation of *levels* (cached
prefixes held once in the KV tree, each possibly read by many rows: the
prompt in front of every particle) and the row's *own part* (the batch's
cache: its copied past and its new tokens). Softmax attention over a
concatenation equals the attention over each part merged by their
log-sum-exps of scores (Hydragen, Juravsky et al. 2024; FlashInfer's cascade
attention), so each level is computed once for all the rows that read it:
their queries and grouped heads together against one copy of the level, a
matrix-matrix product, instead of once per row. Only the own part is masked
(a level precedes every query of its rows).

Everything is torch operations: on CPU the fused flash kernel that returns
the log-sum-exp, on CUDA the fused flash (half precision) or memory-efficient
(float32, masks) kernels, elsewhere a chunked plain product. All agree with
an uncached forward within float32 rounding (``tests/test_hf_shared_prefix.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from genlm_backend.cache.kv_block import KVBlock

_MATH_CHUNK_SCORES = 1 << 24
"""Most attention scores the plain-product path holds at once (64 MiB of float32)."""


@dataclass(frozen=True)
class Level:
    """A cached prefix read by some rows of a batch: ``block``'s ``row``, slots ``[start, start + length)``.

    ``rows``: the batch rows that read it, ``None`` for all of them.
    """

    block: KVBlock
    row: int
    start: int
    length: int
    rows: torch.Tensor | None

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[1, H, length, D]`` of the level's keys and values in ``layer``."""
        keys, values = self.block.layers[layer]
        span = slice(self.start, self.start + self.length)
        return keys[self.row : self.row + 1, :, span], values[self.row : self.row + 1, :, span]


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and the log-sum-exp of each query's scores.

    Args:
        query: ``[B, Hq, L, D]``.
        key, value: ``[B, Hkv, S, D]``, ``Hq`` a multiple of ``Hkv`` (grouped heads are not repeated).
        mask: Additive ``[B, 1, L, S]`` (``-inf`` or the dtype's minimum where hidden) or ``None``.
        scale: Factor of the scores.

    Returns:
        ``output [B, Hq, L, D]`` in ``query``'s dtype and ``lse [B, Hq, L]`` in float32.
    """
    if query.device.type == "cpu":
        output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=mask, scale=scale
        )
        return output, lse.float()
    if query.device.type == "cuda":
        return _cuda_attention_with_lse(query, key, value, mask, scale)
    return _math_attention_with_lse(query, key, value, mask, scale)


def _cuda_attention_with_lse(query, key, value, mask, scale):
    num_rows, num_q_heads, num_queries, head_dim = query.shape
    num_groups = num_q_heads // key.shape[1]
    if mask is None and query.dtype in (torch.float16, torch.bfloat16):
        # Flash kernel: grouped heads as more queries of their key/value head, [B, Hkv, g * L, D].
        grouped = query.reshape(num_rows, key.shape[1], num_groups * num_queries, head_dim)
        output, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            grouped, key, value, 0.0, False, False, scale=scale
        )
        return output.reshape(query.shape), lse.reshape(query.shape[:3]).float()
    # Memory-efficient kernel: any float dtype and masks, one query head per key/value
    # head: grouped heads go in as more queries of their key/value head, as above.
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    grouped = query.reshape(num_rows, num_kv_heads, num_groups * num_queries, head_dim)
    bias = None
    if mask is not None:
        # Each query's mask row, once per grouped head; the bias's rows must be
        # 16-element aligned: pad the storage, pass a view.
        padded = mask.new_empty(
            num_rows, num_kv_heads, num_groups, num_queries, math.ceil(num_keys / 16) * 16
        )
        padded[..., :num_keys].copy_(mask[:, :, None])
        bias = padded.view(num_rows, num_kv_heads, num_groups * num_queries, -1)[..., :num_keys]
    output, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        grouped, key, value, bias, True, 0.0, False, scale=scale
    )
    num_grouped = num_groups * num_queries
    return output.reshape(query.shape), lse[..., :num_grouped].reshape(query.shape[:3]).float()


def _math_attention_with_lse(query, key, value, mask, scale):
    """Plain products, grouped heads kept grouped, in query chunks of bounded size."""
    num_batch, num_q_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    num_groups = num_q_heads // num_kv_heads
    # query: [B, Hkv, g, L, D]; key: [B, Hkv, 1, S, D]
    grouped = query.view(num_batch, num_kv_heads, num_groups, num_queries, head_dim).float()
    key, value = key[:, :, None].float(), value[:, :, None].float()
    chunk = max(1, _MATH_CHUNK_SCORES // max(1, num_batch * num_q_heads * num_keys))
    outputs, lses = [], []
    for begin in range(0, num_queries, chunk):
        scores = grouped[:, :, :, begin : begin + chunk] @ key.transpose(-1, -2) * scale
        if mask is not None:
            scores = scores + mask[:, :, None, begin : begin + chunk].float()
        lse = scores.logsumexp(-1)
        outputs.append(torch.exp(scores - lse[..., None]) @ value)
        lses.append(lse)
    output = torch.cat(outputs, dim=3).view(num_batch, num_q_heads, num_queries, head_dim)
    lse = torch.cat(lses, dim=3).view(num_batch, num_q_heads, num_queries)
    return output.to(query.dtype), lse


def _group_queries(query: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[R, Hkv * g, L, D]`` -> ``[1, Hkv, R * g * L, D]``: every row's queries of a key/value head together."""
    num_rows, num_q_heads, num_queries, head_dim = query.shape
    num_kv_heads = num_q_heads // num_groups
    grouped = query.view(num_rows, num_kv_heads, num_groups, num_queries, head_dim)
    return grouped.transpose(0, 1).reshape(1, num_kv_heads, -1, head_dim)


def _ungroup(grouped: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`_group_queries` for outputs (``shape = [R, Hq, L, D]``) or log-sum-exps (``[R, Hq, L]``)."""
    num_rows, num_q_heads = shape[0], shape[1]
    num_kv_heads = grouped.shape[1]
    per_head = grouped.view(num_kv_heads, num_rows, num_q_heads // num_kv_heads, *shape[2:])
    return per_head.transpose(0, 1).reshape(shape)


def level_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query of ``query`` (``[R, Hq, L, D]``) over one level (``[1, Hkv, n, D]``), unmasked.

    The level's keys are read once for all ``R`` rows and grouped heads.
    """
    num_groups = query.shape[1] // keys.shape[1]
    output, lse = attention_with_lse(_group_queries(query, num_groups), keys, values, None, scale)
    return _ungroup(output, query.shape), _ungroup(lse, query.shape[:3])


def _merge(output, lse, part_output, part_lse, with_lse: bool = True):
    """Attention over the union of two key sets, from each one's output (float32) and log-sum-exp.

    The first set's share of the softmax mass is ``sigmoid(lse - part_lse)``;
    the merged log-sum-exp (``None`` unless ``with_lse``) is needed only if
    another set follows.
    """
    share = torch.sigmoid(lse - part_lse)
    merged = torch.lerp(part_output.float(), output, share[..., None])
    return merged, torch.logaddexp(lse, part_lse) if with_lse else None


def cascade_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    levels: list[Level],
) -> torch.Tensor:
    """Attention of a batch over its levels and its own part, merged exactly.

    Args:
        layer: Index of the attention layer (which of each level's tensors to read).
        query: ``[B, Hq, L, D]``.
        key, value: The own part, ``[B, Hkv, S, D]``.
        mask: Additive ``[B, 1, L, S]`` over the own part.
        levels: The cached prefixes, each fully visible to its rows' queries.

    Returns:
        ``[B, L, Hq, D]`` in ``query``'s dtype, the layout transformers' attention functions return.
    """
    output, lse = attention_with_lse(query, key, value, mask, scale)
    output = output.float()
    for number, level in enumerate(levels, 1):
        level_keys, level_values = level.keys_values(layer)
        with_lse = number < len(levels)
        if level.rows is None:
            part_output, part_lse = level_attention(query, level_keys, level_values, scale)
            output, merged_lse = _merge(output, lse, part_output, part_lse, with_lse)
            lse = merged_lse if merged_lse is not None else lse
            continue
        part_output, part_lse = level_attention(
            query.index_select(0, level.rows), level_keys, level_values, scale
        )
        merged, merged_lse = _merge(
            output.index_select(0, level.rows),
            lse.index_select(0, level.rows),
            part_output,
            part_lse,
            with_lse,
        )
        output = output.index_copy(0, level.rows, merged)
        if merged_lse is not None:
            lse = lse.index_copy(0, level.rows, merged_lse)
    return output.to(query.dtype).transpose(1, 2).contiguous()
