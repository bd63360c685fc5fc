"""A level's attention split along its keys, in Triton: one kernel for the chunks, one for their merge.

:mod:`~genlm_backend.llm.hf.split_level` says why and holds the torch
reference. Here ``level_chunk`` runs one program per (block of queries,
key/value head, chunk of keys): it folds its chunk's keys in blocks of
``BN`` (flash attention's online softmax, in float32) and writes the chunk's
output and log-sum-exp. ``merge_level_chunks`` then folds each query's chunks
in order into the level's output and log-sum-exp. With one chunk the first
kernel writes the level's results itself. Without a GPU, Triton's
interpreter runs both on the CPU (``TRITON_INTERPRET=1``), which the tests use.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from genlm_backend.llm.hf.split_level import check_level_inputs, supports_head_dim

MIN_CHUNK_KEYS = 256
"""Fewest keys a chunk gets from :func:`chunk_keys_for`: a chunk's partial output (float32, one
row per query) costs a write and a read, so a chunk must carry many more keys than that."""

PROGRAMS_PER_SM = 2
"""Programs :func:`chunk_keys_for` aims at per multiprocessor: two to overlap one's loads with another's products."""

MERGE_BLOCK = 64
"""(Row, query head) pairs a merge program holds: ``MERGE_BLOCK * D`` float32 a chunk."""


def split_level_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    chunk_keys: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` over one level, its keys split into chunks read by their own programs.

    The function of :func:`~genlm_backend.llm.hf.split_level.split_level_reference`, in two kernels.

    Args:
        query: ``[N, Hq, D]`` (any strides); query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
        key: The level's keys, ``[Hkv, S, D]`` (any strides), all visible to every query.
        value: Its values, ``[Hkv, S, D]``.
        scale: Multiplies every score.
        chunk_keys: Keys a chunk; ``None``: :func:`plan_split`'s choice for the device.

    Returns:
        ``[N, Hq, D]`` in ``query``'s dtype and ``[N, Hq]`` float32 log-sum-exps of
        scores; with ``S == 0``, zeros and ``-inf``.

    Raises:
        ValueError: inputs :func:`~genlm_backend.llm.hf.split_level.check_level_inputs`
            refuses, a head size the tiles do not fit, or ``chunk_keys < 1``.
    """
    check_level_inputs(query, key, value)
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[:2]
    if not supports_head_dim(head_dim):
        raise ValueError(
            f"the split kernel takes head sizes 16 to 256 that are powers of two, not {head_dim}"
        )
    output = query.new_empty(num_rows, num_q_heads, head_dim)
    lse = torch.empty(num_rows, num_q_heads, dtype=torch.float32, device=query.device)
    if num_keys == 0 or num_rows == 0:
        return output.zero_(), lse.fill_(-torch.inf)
    num_groups = num_q_heads // num_kv_heads
    split = plan_split(
        num_rows * num_groups, num_kv_heads, num_keys, head_dim, query.device, chunk_keys
    )
    if split.num_chunks == 1:  # the chunk is the level: its results are the level's
        chunk_out, chunk_lse = output[None], lse[None]
    else:
        chunk_out = query.new_empty(split.num_chunks, *output.shape, dtype=torch.float32)
        chunk_lse = lse.new_empty(split.num_chunks, *lse.shape)
    level_chunk[(split.num_query_blocks, num_kv_heads, split.num_chunks)](
        query, *query.stride(),
        key, *key.stride(),
        value, *value.stride(),
        chunk_out, *chunk_out.stride(),
        chunk_lse, *chunk_lse.stride(),
        num_rows * num_groups, num_groups, num_keys, split.chunk_keys, scale * math.log2(math.e),
        PRECISION=_precision(query.dtype), D=head_dim,
        BM=split.block_queries, BN=split.block_keys, num_warps=split.num_warps,
    )  # fmt: skip
    if split.num_chunks > 1:
        merge_level_chunks[(triton.cdiv(num_rows * num_q_heads, MERGE_BLOCK),)](
            chunk_out, *chunk_out.stride(),
            chunk_lse, *chunk_lse.stride(),
            output, *output.stride(),
            lse, *lse.stride(),
            num_rows * num_q_heads, num_q_heads, split.num_chunks,
            D=head_dim, BM=MERGE_BLOCK,
        )  # fmt: skip
    return output, lse


@dataclass(frozen=True)
class Split:
    """How one level's read is laid out: programs of ``block_queries`` queries of one key/value
    head by one chunk of ``chunk_keys`` keys, read ``block_keys`` at a time."""

    block_queries: int
    block_keys: int
    num_warps: int
    num_query_blocks: int
    """Per key/value head."""
    chunk_keys: int
    num_chunks: int


def plan_split(
    num_queries: int,
    num_kv_heads: int,
    num_keys: int,
    head_dim: int,
    device: torch.device,
    chunk_keys: int | None = None,
) -> Split:
    """The :class:`Split` of ``num_queries`` queries per key/value head over ``num_keys`` keys.

    A program's tile: up to 64 queries (fewer for fewer queries; products take
    16 or more) by 64 keys a block (32 each for heads of 256, for registers:
    the float32 accumulator is ``[queries, D]``). ``chunk_keys=None``:
    :func:`chunk_keys_for` the device's multiprocessors.

    Raises:
        ValueError: ``chunk_keys < 1``.
    """
    block = 64 if head_dim <= 128 else 32
    block_queries = min(block, max(16, triton.next_power_of_2(num_queries)))
    num_query_blocks = triton.cdiv(num_queries, block_queries)
    if chunk_keys is None:
        chunk_keys = chunk_keys_for(
            num_keys, num_query_blocks * num_kv_heads, _num_sms(device), block
        )
    if chunk_keys < 1:
        raise ValueError(f"chunk_keys must be positive, got {chunk_keys}")
    return Split(
        block_queries=block_queries,
        block_keys=block,
        num_warps=4 if head_dim <= 64 else 8,
        num_query_blocks=num_query_blocks,
        chunk_keys=chunk_keys,
        num_chunks=triton.cdiv(num_keys, chunk_keys),
    )


def splits(
    num_queries: int, num_kv_heads: int, num_keys: int, head_dim: int, device: torch.device
) -> bool:
    """Whether :func:`plan_split` splits this level into chunks on ``device`` (else one flash
    call, whose programs already fill the device or whose level is short, does as well)."""
    return plan_split(num_queries, num_kv_heads, num_keys, head_dim, device).num_chunks > 1


def chunk_keys_for(num_keys: int, num_unsplit_programs: int, num_sms: int, block_keys: int) -> int:
    """Keys a chunk, so that the chunks' programs fill the device.

    Enough chunks that ``num_unsplit_programs`` (query blocks times key/value
    heads) times their number reach :data:`PROGRAMS_PER_SM` programs per
    multiprocessor, none shorter than :data:`MIN_CHUNK_KEYS` keys, a chunk a
    multiple of ``block_keys`` (its last one ragged). One chunk (no split)
    where the unsplit programs already fill the device or the level is short.
    """
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(1, num_unsplit_programs))
    num_chunks = max(1, min(wanted, num_keys // MIN_CHUNK_KEYS))
    return triton.cdiv(triton.cdiv(num_keys, num_chunks), block_keys) * block_keys


def _precision(dtype: torch.dtype) -> str | None:
    """float32 products in float32, not tf32 (torch's float32 attention does the same); else the default.

    (Helpers called from a kernel cost the interpreter a module scan each call, so products are inline.)"""
    return "ieee" if dtype == torch.float32 else None


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device``, asked once (before any graph is captured: the warm-up's call)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # Triton's interpreter: one program at a time


@triton.jit
def level_chunk(
    Q, sqn, sqh, sqd,
    K, skh, sks, skd,
    V, svh, svs, svd,
    OUT, soc, son, soh, sod,
    LSE, slc, sln, slh,
    num_queries, num_groups, num_keys, chunk_keys, scale_log2,
    PRECISION: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # BM of one key/value head's queries (rows, then grouped heads) against one chunk of keys.
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    at = tl.program_id(0) * BM + tl.arange(0, BM)
    valid = at < num_queries
    rows = at // num_groups
    heads = kv_head * num_groups + at % num_groups
    dims = tl.arange(0, D)
    q = tl.load(
        Q + rows[:, None] * sqn + heads[:, None] * sqh + dims[None, :] * sqd,
        mask=valid[:, None], other=0.0,
    )  # fmt: skip
    # scores in base 2 (exp2 is the hardware's): scale * log2(e) applied in float32
    top = tl.full([BM], float("-inf"), tl.float32)
    total = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    start = chunk * chunk_keys
    end = tl.minimum(start + chunk_keys, num_keys)
    for block in range(start, end, BN):
        keys = block + tl.arange(0, BN)
        seen = keys < end  # the ragged last block
        k = tl.load(
            K + kv_head * skh + keys[None, :] * sks + dims[:, None] * skd,
            mask=seen[None, :], other=0.0,
        )  # fmt: skip
        v = tl.load(
            V + kv_head * svh + keys[:, None] * svs + dims[None, :] * svd,
            mask=seen[:, None], other=0.0,
        )  # fmt: skip
        scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        weights = tl.exp2(scores - new_top[:, None])
        rescale = tl.exp2(top - new_top)  # 0 for the first block (top is -inf)
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    out = acc / total[:, None]
    lse = (top + tl.log2(total)) * 0.6931471805599453  # back to base e
    tl.store(
        OUT + chunk * soc + rows[:, None] * son + heads[:, None] * soh + dims[None, :] * sod,
        out.to(OUT.dtype.element_ty), mask=valid[:, None],
    )  # fmt: skip
    tl.store(LSE + chunk * slc + rows * sln + heads * slh, lse, mask=valid)


@triton.jit
def merge_level_chunks(
    PART, spc, spn, sph, spd,
    PART_LSE, slc, sln, slh,
    OUT, son, soh, sod,
    LSE, sn, sh,
    num_pairs, num_heads, num_chunks,
    D: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    # BM (row, query head) pairs: their chunks folded in order, each weighed by its share of the mass.
    pairs = tl.program_id(0) * BM + tl.arange(0, BM)
    valid = pairs < num_pairs
    rows = pairs // num_heads
    heads = pairs % num_heads
    dims = tl.arange(0, D)
    top = tl.full([BM], float("-inf"), tl.float32)
    total = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for chunk in range(num_chunks):
        lse = tl.load(PART_LSE + chunk * slc + rows * sln + heads * slh, mask=valid, other=0.0)
        part = tl.load(
            PART + chunk * spc + rows[:, None] * spn + heads[:, None] * sph + dims[None, :] * spd,
            mask=valid[:, None], other=0.0,
        )  # fmt: skip
        new_top = tl.maximum(top, lse)
        weight = tl.exp(lse - new_top)
        rescale = tl.exp(top - new_top)  # 0 for the first chunk (top is -inf)
        total = total * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * part
        top = new_top
    tl.store(
        OUT + rows[:, None] * son + heads[:, None] * soh + dims[None, :] * sod,
        (acc / total[:, None]).to(OUT.dtype.element_ty), mask=valid[:, None],
    )  # fmt: skip
    tl.store(LSE + rows * sn + heads * sh, top + tl.log(total), mask=valid)
