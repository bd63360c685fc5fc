"""Exact attention in fused kernels (Triton): a fixed left fold over key blocks, carried across levels.

:func:`~genlm_backend.llm.hf.exact.exact_attention` makes a row's bits
independent of its batch with torch operations: every score first, an exact
maximum, block sums merged in a fixed tree. That is some 70 kernels a layer
on CUDA, and a one-token step spends its time launching and running them.
This module computes the same function in one kernel a layer for the rows'
own parts and one for each level, with another fixed order:

* each query's keys go in blocks of :data:`BLOCK_KEYS` at fixed positions
  (``0, b, 2b, ...``), always in that order, folded into a running maximum,
  sum of weights and weighted values (flash attention's online softmax);
* the fold's state is carried from source to source in position order: each
  level (a cached prefix held once, read by many rows) folds its blocks for
  all its readers' queries together (``fold_level``), and its readers'
  own parts go on from the state it leaves (``fold_own``);
* a block is folded by the same code whatever holds its keys and whatever
  else shares the program: ``BLOCK_QUERIES`` queries a program, one block
  shape, one product shape, so a query's arithmetic depends only on its
  context's keys. A block of keys a query does not see changes nothing of
  its state (its weights are exact zeros, its rescaling an exact one).

A row alone, from an empty cache, folds its keys as one own part; the same
row behind levels, in a step, or beside any others folds the same blocks in
the same order with the same operations: the same bits. Levels start and end
at multiples of :data:`BLOCK_KEYS` (``LevelPolicy.block_tokens``), and a
row's own part starts where its last level ends.

The results agree with :func:`~genlm_backend.llm.hf.exact.exact_attention`
within rounding, not bitwise: the two orders differ. A process uses one of
them for every pass on a device (:func:`~genlm_backend.llm.hf.exact.uses_fused_kernels`), so every row it
computes there is exact under one order. Without a GPU, Triton's interpreter
runs these kernels on the CPU (``TRITON_INTERPRET=1``), which the tests use.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from genlm_backend.llm.hf.exact.layout import ExactLayout
from genlm_backend.llm.hf.exact.numerics import BLOCK_TOKENS
from genlm_backend.llm.hf.exact.torch_order import in_runs

BLOCK_KEYS = BLOCK_TOKENS
"""Keys folded at a time (the positions of the blocks are fixed: ``0, b, 2b, ...``)."""

BLOCK_QUERIES = 16
"""Queries a program holds: every product has this many rows, whatever the pass."""


def fused_exact_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    layout: ExactLayout,
) -> torch.Tensor:
    """Exact attention (the contract of :func:`~genlm_backend.llm.hf.exact.exact_attention`) in fused kernels.

    Args:
        layer: Index of the attention layer (which of each level's tensors to read).
        query: ``[B, Hq, L, D]``.
        key: The pass's block of keys, ``[B, Hkv, S, D]``; ``layout.own_index`` gives each row's own keys there.
        value: Likewise, the values.
        layout: The pass's :class:`~genlm_backend.llm.hf.exact.ExactLayout`.

    Returns:
        ``[B, L, Hq, D]`` in ``query``'s dtype.
    """
    if layout.chunks:
        return in_runs(
            query,
            layout,
            lambda run, part: fused_exact_attention(layer, run, key, value, scale, part),
        )
    num_rows, num_q_heads, num_new, head_dim = query.shape
    num_kv_heads = key.shape[1]
    num_groups = num_q_heads // num_kv_heads
    num_queries = num_groups * num_new  # per key/value head: grouped heads, then positions
    ieee = query.dtype == torch.float32  # float32 products in float32, not tf32
    out = query.new_empty(num_rows, num_new, num_q_heads, head_dim)
    state = None
    if layout.levels:
        shape = (num_rows, num_kv_heads, num_queries)
        state = (
            torch.full(shape, -torch.inf, dtype=torch.float32, device=query.device),
            torch.zeros(shape, dtype=torch.float32, device=query.device),
            torch.zeros(*shape, head_dim, dtype=torch.float32, device=query.device),
        )
        # a row's levels are disjoint prefixes: in the order of their first blocks, each
        # goes on from the state the one before it left
        for level, _ in sorted(layout.levels, key=lambda placed: placed[1]):
            level_keys, level_values = level.keys_values(layer)  # [1, Hkv, n, D]
            num_readers = num_rows if level.rows is None else level.rows.numel()
            rows = level.rows if level.rows is not None else out  # out: an unread pointer
            row_bias = level.row_bias if level.row_bias is not None else out
            level_grid = (num_kv_heads, -(-num_readers * num_queries // BLOCK_QUERIES))
            fold_level[level_grid](
                query, *query.stride(),
                level_keys[0], *level_keys[0].stride(),
                level_values[0], *level_values[0].stride(),
                rows, row_bias, *state,
                num_queries, num_new, num_groups, num_readers, level_keys.shape[2],
                num_kv_heads, scale,
                HAS_ROWS=level.rows is not None, HAS_ROW_BIAS=level.row_bias is not None,
                D=head_dim, BM=BLOCK_QUERIES, BN=BLOCK_KEYS, IEEE=ieee,
            )  # fmt: skip
    own_index, own_bias = layout.own_index, layout.own_bias  # [B, S'], [B, 1, M', S']
    grid = (num_rows, num_kv_heads, -(-num_queries // BLOCK_QUERIES))
    fold_own[grid](
        query, *query.stride(),
        key, *key.stride(),
        value, *value.stride(),
        own_index, own_index.stride(0),
        own_bias, own_bias.stride(0), own_bias.stride(2),
        *(state if state is not None else (out, out, out)),
        out, *out.stride(),
        num_queries, num_new, num_groups, own_index.shape[1], scale,
        HAS_STATE=state is not None,
        D=head_dim, BM=BLOCK_QUERIES, BN=BLOCK_KEYS, IEEE=ieee,
    )  # fmt: skip
    return out


@triton.jit
def load_queries(Q, rows, heads, positions, valid, sqb, sqh, sql, sqd, scale, D: tl.constexpr):
    dims = tl.arange(0, D)
    q = tl.load(
        Q + rows[:, None] * sqb + heads[:, None] * sqh + positions[:, None] * sql
        + dims[None, :] * sqd,
        mask=valid[:, None], other=0.0,
    )  # fmt: skip
    return (q.to(tl.float32) * scale).to(Q.dtype.element_ty)


@triton.jit
def product(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def fold_block(q, k, v, bias, top, total, acc, IEEE: tl.constexpr):
    # q: [BM, D], k: [D, BN], v: [BN, D], bias: [BM, BN] (0, or -inf for a key not seen)
    scores = product(q, k, IEEE) + bias
    new_top = tl.maximum(top, tl.max(scores, axis=1))
    # a query that has seen no key yet subtracts 0: its weights are exp(-inf) = 0
    shift = tl.where(new_top == float("-inf"), 0.0, new_top)
    weights = tl.exp(scores - shift[:, None])
    rescale = tl.exp(top - shift)  # exactly 1 where the top did not move
    total = total * rescale + tl.sum(weights, axis=1)
    acc = acc * rescale[:, None] + product(weights.to(v.dtype), v, IEEE)
    return new_top, total, acc


@triton.jit
def fold_level(
    Q, sqb, sqh, sql, sqd,
    K, skh, sks, skd,
    V, svh, svs, svd,
    ROWS, ROW_BIAS, TOP, TOTAL, ACC,
    num_queries, num_new, num_groups, num_readers, num_keys, num_kv_heads, scale,
    HAS_ROWS: tl.constexpr, HAS_ROW_BIAS: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # One key/value head, BM of the readers' queries; the level's keys, all seen.
    head = tl.program_id(0)
    at = tl.program_id(1) * BM + tl.arange(0, BM)
    valid = at < num_readers * num_queries
    reader, query = at // num_queries, at % num_queries
    rows = tl.load(ROWS + reader, mask=valid, other=0) if HAS_ROWS else reader
    heads = head * num_groups + query // num_new
    q = load_queries(Q, rows, heads, query % num_new, valid, sqb, sqh, sql, sqd, scale, D)
    dims = tl.arange(0, D)
    state = (rows * num_kv_heads + head) * num_queries + query
    top = tl.load(TOP + state, mask=valid, other=float("-inf"))
    total = tl.load(TOTAL + state, mask=valid, other=0.0)
    acc = tl.load(ACC + state[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0)
    row_bias = tl.zeros([BM], tl.float32)
    if HAS_ROW_BIAS:  # -inf for a row the level leaves out: its blocks change nothing
        row_bias = tl.load(ROW_BIAS + rows, mask=valid, other=0.0)
    bias = tl.zeros([BM, BN], tl.float32) + row_bias[:, None]
    for start in range(0, num_keys, BN):
        keys = start + tl.arange(0, BN)
        k = tl.load(K + head * skh + keys[None, :] * sks + dims[:, None] * skd)
        v = tl.load(V + head * svh + keys[:, None] * svs + dims[None, :] * svd)
        top, total, acc = fold_block(q, k, v, bias, top, total, acc, IEEE)
    tl.store(TOP + state, top, mask=valid)
    tl.store(TOTAL + state, total, mask=valid)
    tl.store(ACC + state[:, None] * D + dims[None, :], acc, mask=valid[:, None])


@triton.jit
def fold_own(
    Q, sqb, sqh, sql, sqd,
    K, skb, skh, sks, skd,
    V, svb, svh, svs, svd,
    SLOTS, s_slots, BIAS, sbb, sbm,
    TOP, TOTAL, ACC,
    OUT, sob, sol, soh, sod,
    num_queries, num_new, num_groups, num_keys, scale,
    HAS_STATE: tl.constexpr,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # One row, one key/value head, BM of its queries; its own keys, from its slots.
    row = tl.program_id(0)
    head = tl.program_id(1)
    query = tl.program_id(2) * BM + tl.arange(0, BM)
    valid = query < num_queries
    rows = tl.zeros([BM], tl.int64) + row
    heads = head * num_groups + query // num_new
    positions = query % num_new
    q = load_queries(Q, rows, heads, positions, valid, sqb, sqh, sql, sqd, scale, D)
    dims = tl.arange(0, D)
    if HAS_STATE:
        state = (row * tl.num_programs(1) + head) * num_queries + query
        top = tl.load(TOP + state, mask=valid, other=float("-inf"))
        total = tl.load(TOTAL + state, mask=valid, other=0.0)
        acc = tl.load(ACC + state[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0)
    else:
        top = tl.full([BM], float("-inf"), tl.float32)
        total = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
    for start in range(0, num_keys, BN):
        keys = start + tl.arange(0, BN)
        slots = tl.load(SLOTS + row * s_slots + keys)
        k = tl.load(K + row * skb + head * skh + slots[None, :] * sks + dims[:, None] * skd)
        v = tl.load(V + row * svb + head * svh + slots[:, None] * svs + dims[None, :] * svd)
        bias = tl.load(
            BIAS + row * sbb + query[:, None] * sbm + keys[None, :],
            mask=valid[:, None], other=float("-inf"),
        )  # fmt: skip
        top, total, acc = fold_block(q, k, v, bias, top, total, acc, IEEE)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        OUT + row * sob + positions[:, None] * sol + heads[:, None] * soh
        + dims[None, :] * sod,
        out.to(OUT.dtype.element_ty), mask=valid[:, None],
    )  # fmt: skip


class RowMeans(torch.overrides.TorchFunctionMode):
    """While active, a mean over the last dimension of a CUDA tensor (an RMS norm's) is computed
    one row per program (:func:`row_means`).

    torch's CUDA reductions split a row among more threads when there are few
    rows (their launch shape follows the number of outputs). On an H100
    (torch 2.11, the Llama-3.2-1B shape) a position got other keys in a
    5-token pass than in a 53-token one while every attention call and every
    projection gave the same bits for the same inputs: a norm's mean is the
    reduction left in the layer. Other functions run as they are.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.mean or func is torch.mean:
            keepdim = _last_dim_mean(args, kwargs)
            if keepdim is not None:
                return row_means(args[0], keepdim)
        return func(*args, **kwargs)


def _last_dim_mean(args, kwargs) -> bool | None:
    """``keepdim`` of a ``mean`` call over the last dimension of a floating CUDA tensor (``None``: another call)."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or x.device.type == "meta" or x.dim() == 0:
        return None
    if not (x.is_cuda or uses_interpreter()) or not x.is_floating_point():
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if isinstance(dim, (tuple, list)):
        dim = dim[0] if len(dim) == 1 else None
    if dim is None or dim % x.dim() != x.dim() - 1 or kwargs.get("dtype") is not None:
        return None
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return bool(keepdim)


def uses_interpreter() -> bool:
    """Whether Triton runs its kernels on the CPU here (``TRITON_INTERPRET=1``, the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def row_means(x: torch.Tensor, keepdim: bool) -> torch.Tensor:
    """``x.mean(-1, keepdim)``, each row summed in float32 by one program in a fixed order."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows, num_cols = rows.shape
    out = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        block = triton.next_power_of_2(num_cols)
        row_mean[(num_rows,)](
            rows,
            out,
            num_cols,
            rows.stride(0),
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
    return out.view(shape).to(x.dtype)


@triton.jit
def row_mean(X, OUT, num_cols, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_row + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
    tl.store(OUT + row, tl.sum(x, axis=0) / num_cols)
