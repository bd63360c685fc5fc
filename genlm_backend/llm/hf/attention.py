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

Torch operations compute it: on CPU the fused flash kernel that returns
the log-sum-exp, on CUDA the fused flash (half precision) or memory-efficient
(float32, masks) kernels, elsewhere a chunked plain product. On CUDA with
Triton, a long level is read by :mod:`~genlm_backend.llm.hf.split_level`'s
kernel instead: its keys split into chunks over many programs (one flash call
has too few to read it at the memory's bandwidth). All agree with
an uncached forward within float32 rounding (``tests/test_hf_shared_prefix.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from genlm_backend.cache.kv_block import KVBlock
from genlm_backend.llm.hf import split_level

_MATH_CHUNK_SCORES = 1 << 24
"""Most attention scores the plain-product path holds at once (64 MiB of float32)."""


@dataclass(frozen=True)
class Level:
    """A cached prefix read by some rows of a batch: ``block``'s ``row``, slots ``[start, start + length)``.

    ``rows``: the batch rows that read it, ``None`` for all of them.
    ``row_bias``: with ``rows=None``, a float32 ``[B]`` tensor added to each
    row's log-sum-exp over the level: ``0`` where the row reads it, ``-inf``
    where it does not (the level then weighs nothing in the merge). Which rows
    read a level is then device data, as a captured step needs.
    """

    block: KVBlock
    row: int
    start: int
    length: int
    rows: torch.Tensor | None
    row_bias: torch.Tensor | None = None

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The level's keys and values in ``layer``, ``[1, H, length, D]`` (views, or the block's own tensors)."""
        keys, values = self.block.layers[layer]
        if keys.shape[0] == 1 and self.start == 0 and self.length == keys.shape[2]:
            return keys, values  # a block holding just this level, such as a prompt's
        span = slice(self.start, self.start + self.length)
        return keys[self.row : self.row + 1, :, span], values[self.row : self.row + 1, :, span]


class Cascade:
    """What every attention layer of one forward pass reads besides its own part.

    Holds the pass's levels, and the own part's mask in the layout the
    device's kernel takes, made by the first layer for all of them.
    """

    def __init__(self, levels: list[Level]):
        self.levels = levels
        self._kernel_masks: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def kernel_mask(self, mask: torch.Tensor, num_groups: int, num_kv_heads: int) -> torch.Tensor:
        """:func:`kernel_mask` of ``mask``, made once per pass."""
        key = (id(mask), num_groups, num_kv_heads)
        made = self._kernel_masks.get(key)
        if made is None or made[0] is not mask:
            made = self._kernel_masks[key] = (mask, kernel_mask(mask, num_groups, num_kv_heads))
        return made[1]


def kernel_mask(mask: torch.Tensor, num_groups: int, num_kv_heads: int) -> torch.Tensor:
    """An additive ``[B, 1, L, S]`` mask in the layout :func:`grouped_attention_with_lse` hands its device's kernel.

    On CUDA the memory-efficient kernel takes one query head per key/value
    head, grouped heads going in as more queries: each query's mask row once
    per grouped head, ``[B, Hkv, g * L, S]``, rows 16-element aligned (a view
    of padded storage). Elsewhere the mask itself.
    """
    if _device_kernels(mask.device) != "cuda":
        return mask
    num_rows, _, num_queries, num_keys = mask.shape
    padded = mask.new_empty(
        num_rows, num_kv_heads, num_groups, num_queries, math.ceil(num_keys / 16) * 16
    )
    padded[..., :num_keys].copy_(mask[:, :, None])
    return padded.view(num_rows, num_kv_heads, num_groups * num_queries, -1)[..., :num_keys]


def grouped_attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and each query's log-sum-exp, ``mask`` made by :func:`kernel_mask`; results ``[B, Hkv, g, L, D]`` and ``[B, Hkv, g, L]``.

    The results are views of the kernel's outputs, grouped heads next to
    their key/value head.
    """
    num_rows, num_q_heads, num_queries, head_dim = query.shape
    heads = (key.shape[1], num_q_heads // key.shape[1])
    kernels = _device_kernels(query.device)
    if kernels == "cpu":
        output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=mask, scale=scale
        )
        return output.unflatten(1, heads), _float32(lse).unflatten(1, heads)
    if kernels == "cuda":
        # Grouped heads as more queries of their key/value head: [B, Hkv, g * L, D].
        grouped = query.reshape(num_rows, heads[0], heads[1] * num_queries, head_dim)
        output, lse = _cuda_attention_with_lse(grouped, key, value, mask, scale)
        shape = (heads[1], num_queries)
        return output.unflatten(2, shape), lse.unflatten(2, shape)
    return math_attention_with_lse(query, key, value, mask, scale)


def prefix_attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``[1, Hkv, N, D]`` queries over ``[1, Hkv, S, D]`` keys, unmasked: ``[1, Hkv, N, D]`` and ``[1, Hkv, N]``.

    One query per key/value head position: the layout in which a level's
    keys are read once by every row and grouped head. Nothing but the kernel
    runs on CPU and (in half precision) on CUDA.
    """
    kernels = _device_kernels(query.device)
    if kernels == "cpu":
        output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, scale=scale
        )
        return output, _float32(lse)
    if kernels == "cuda":
        return _cuda_attention_with_lse(query, key, value, None, scale)
    output, lse = math_attention_with_lse(query, key, value, None, scale)
    return output.flatten(1, 2), lse.flatten(1, 2)


def _device_kernels(device: torch.device) -> str:
    """The attention kernels used on ``device``: ``"cpu"`` or ``"cuda"``'s fused ones, else ``"math"`` (plain products)."""
    return device.type if device.type in ("cpu", "cuda") else "math"


def _float32(lse: torch.Tensor) -> torch.Tensor:
    return lse if lse.dtype == torch.float32 else lse.float()


def _cuda_attention_with_lse(query, key, value, bias, scale):
    """One query head per key/value head (``[B, Hkv, N, D]``): the fused flash kernel (half
    precision, no mask), else the memory-efficient one (any float dtype, masks made by :func:`kernel_mask`)."""
    if bias is None and query.dtype in (torch.float16, torch.bfloat16):
        output, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, False, False, scale=scale
        )
        return output, lse
    output, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, 0.0, False, scale=scale
    )
    return output, lse[..., : query.shape[2]]  # its rows are padded to a multiple of 32


def math_attention_with_lse(query, key, value, mask, scale):
    """Plain products, grouped heads kept grouped, in query chunks of bounded size: ``[B, Hkv, g, L, D]`` and ``[B, Hkv, g, L]``."""
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
    return torch.cat(outputs, dim=3).to(query.dtype), torch.cat(lses, dim=3)


def _level_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query of ``query`` (``[R, Hkv, g, L, D]``) over one level (``[1, Hkv, n, D]``), unmasked.

    The level's keys are read once for all ``R`` rows and ``g`` grouped heads:
    they go in as ``R * g * L`` queries of their key/value head. Returns
    views ``[R, Hkv, g, L, D]`` (query's dtype) and ``[R, Hkv, g, L]`` (float32).
    """
    num_rows, num_kv_heads, num_groups, num_queries, head_dim = query.shape
    if split_level.uses_split_kernel(query.device, head_dim):
        split = _split_level_attention(query, keys, values, scale)
        if split is not None:
            return split
    grouped = query.transpose(0, 1).reshape(1, num_kv_heads, -1, head_dim)
    output, lse = prefix_attention_with_lse(grouped, keys, values, scale)
    # [1, Hkv, R * g * L, ...] -> [Hkv, R, g, L, ...]: splits one dimension, a view of any strides
    output = output.view(num_kv_heads, num_rows, num_groups, num_queries, head_dim)
    lse = lse.view(num_kv_heads, num_rows, num_groups, num_queries)
    return output.transpose(0, 1), lse.transpose(0, 1)


def _split_level_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`_level_attention` by the split kernel where it splits the level into chunks (``None``
    elsewhere: one flash call has programs enough). Its queries are ``[R * L, Hq, D]``, a view
    for one-token steps."""
    from genlm_backend.llm.hf import split_level_fused

    num_rows, num_kv_heads, num_groups, num_queries, head_dim = query.shape
    num_grouped = num_rows * num_queries * num_groups  # queries per key/value head
    if not split_level_fused.splits(
        num_grouped, num_kv_heads, keys.shape[2], head_dim, query.device
    ):
        return None
    rows = query.permute(0, 3, 1, 2, 4).reshape(num_rows * num_queries, -1, head_dim)
    output, lse = split_level_fused.split_level_attention(rows, keys[0], values[0], scale)
    # [R * L, Hq, ...] -> [R, Hkv, g, L, ...], views
    output = output.view(num_rows, num_queries, num_kv_heads, num_groups, head_dim)
    lse = lse.view(num_rows, num_queries, num_kv_heads, num_groups)
    return output.permute(0, 2, 3, 1, 4), lse.permute(0, 2, 3, 1)


def _merge_into(
    merged: torch.Tensor,
    lse: torch.Tensor,
    part: torch.Tensor,
    part_lse: torch.Tensor,
    other: torch.Tensor | None = None,
) -> None:
    """``merged`` becomes the attention over the union of two key sets; ``lse`` is the first's log-sum-exp.

    The first set's output is ``other`` (``merged`` itself when ``None``);
    its share of the softmax mass is ``sigmoid(lse - part_lse)``. In half
    precision the share is rounded to the outputs' dtype (as every other
    operation of the model's layer is), so no float32 copy of an output is made.
    """
    share = torch.sigmoid(lse - part_lse)
    if share.dtype != merged.dtype:
        share = share.to(merged.dtype)
    torch.lerp(part, merged if other is None else other, share[..., None], out=merged)


def cascade_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cascade: Cascade,
) -> torch.Tensor:
    """Attention of a batch over its levels and its own part, merged exactly.

    Every part is computed in the grouped layout the kernels take and read
    back through views; the merges write into the returned tensor.

    Args:
        layer: Index of the attention layer (which of each level's tensors to read).
        query: ``[B, Hq, L, D]``.
        key: The own part's keys, ``[B, Hkv, S, D]``.
        value: The own part's values, ``[B, Hkv, S, D]``.
        mask: Additive ``[B, 1, L, S]`` over the own part.
        cascade: The pass's levels, each fully visible to its rows' queries.

    Returns:
        ``[B, L, Hq, D]`` in ``query``'s dtype, the layout transformers' attention functions return.
    """
    num_rows, num_q_heads, num_queries, head_dim = query.shape
    heads = (key.shape[1], num_q_heads // key.shape[1])
    own_mask = cascade.kernel_mask(mask, heads[1], heads[0])
    own, lse = grouped_attention_with_lse(query, key, value, own_mask, scale)
    result = query.new_empty(num_rows, num_queries, num_q_heads, head_dim)
    merged = result.transpose(1, 2).unflatten(1, heads)  # [B, Hkv, g, L, D], a view
    query = query.unflatten(1, heads)
    levels = cascade.levels
    for number, level in enumerate(levels):
        level_keys, level_values = level.keys_values(layer)
        first_set = own if number == 0 else None
        if level.rows is None:
            part, part_lse = _level_attention(query, level_keys, level_values, scale)
            if level.row_bias is not None:
                part_lse = part_lse + level.row_bias[:, None, None, None]
            if number + 1 < len(levels):
                next_lse = torch.logaddexp(lse, part_lse)
            _merge_into(merged, lse, part, part_lse, first_set)
            if number + 1 < len(levels):
                lse = next_lse
            continue
        if number == 0:
            merged.copy_(own)
        part, part_lse = _level_attention(
            query.index_select(0, level.rows), level_keys, level_values, scale
        )
        selected = merged.index_select(0, level.rows)
        selected_lse = lse.index_select(0, level.rows)
        if number + 1 < len(levels):
            lse = lse.index_copy(0, level.rows, torch.logaddexp(selected_lse, part_lse))
        _merge_into(selected, selected_lse, part, part_lse)
        merged.index_copy_(0, level.rows, selected)
    if not levels:
        merged.copy_(own)
    return result
