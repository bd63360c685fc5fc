"""Exact rows' constants and numerics: fixed blocks and spans, sums in a fixed tree, ``exp``
whose bits do not depend on a tensor's size, and where rows can be exact at all."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BLOCK_TOKENS = 64
"""Keys per attention block (one product of weights and values each)."""

SPAN_BLOCKS = 4
"""Blocks per span: a span's blocks are summed first, then the spans (:func:`span_sums`)."""

SPAN_TOKENS = SPAN_BLOCKS * BLOCK_TOKENS
"""Keys per span. Levels start and end at span boundaries (``LevelPolicy.block_tokens``), so a
level's blocks are summed into its spans once for all the rows that read it."""

QUERY_CHUNK = 128
"""New positions per row computed together: a longer pass's positions go in runs of this many,
each over only the own keys it can see (the scores of a run stay in cache)."""

MIN_ROWS = 16
"""Rows a matrix product is padded to: from 16 rows on, a row's bits do not depend on the others."""

CUDA_ROWS = 64
"""Rows of every product on CUDA: a pass's rows go in pieces of this many (the last one padded)."""


GRAIN = 32768
"""Elements below which torch runs an elementwise operation on one thread (ATen's ``GRAIN_SIZE``)."""

ALIGN = 32
"""Elements per step of torch's vectorized CPU loops (two AVX-512 float vectors); the rest of a
range goes through a scalar loop whose ``exp`` may round otherwise."""


def aligned_numel(numel: int, num_threads: int) -> int:
    """The least count ``>= numel`` that torch splits among its threads in whole vectorized steps.

    An elementwise operation over ``n`` elements runs on ``t = min(threads, ceil(n / GRAIN))``
    threads, each taking ``ceil(n / t)`` of them; when every share is a multiple of
    :data:`ALIGN`, every element is computed by the vectorized loop, wherever it lies.
    """
    count = -(-numel // ALIGN) * ALIGN
    while True:
        threads = max(1, min(num_threads, -(-count // GRAIN)))
        if count % (ALIGN * threads) == 0:
            return count
        count += ALIGN


def exact_rows_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why rows on ``device`` in ``dtype`` cannot be exact (``None``: they are).

    Exact, and tested, on the CPU in float32 and bfloat16 and on CUDA in
    bfloat16. On CUDA, float32 and float16 rows of a context prefilled beside
    others still got other bits than alone (up to 1.4e-5 and 1.2e-2 on an H100,
    torch 2.11): the attention's products there pick their kernels by shape too.
    """
    exact = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}
    if dtype in exact.get(device.type, ()):
        return None
    if device.type == "cuda":
        return (
            f"on CUDA, rows are exact in bfloat16 only (the model is {dtype}): in float32 and "
            f"float16 a row's bits still change with its batch there; load the model in bfloat16 "
            f"(from_name(..., hf_opts={{'dtype': torch.bfloat16, 'device_map': 'cuda'}}))"
        )
    if device.type == "cpu":
        return f"on the CPU, rows are exact in float32 and bfloat16 (the model is {dtype})"
    return f"rows are exact on the CPU and on CUDA (bfloat16), not on {device.type}"


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_fused_kernels(device: torch.device) -> bool:
    """Whether exact attention on ``device`` runs the fused kernels of
    :mod:`~genlm_backend.llm.hf.exact.fused` (another fixed order than :func:`exact_attention`'s
    torch operations, used for every pass there).

    On CUDA whenever Triton is installed (torch's CUDA wheels bring it), for
    models whose head size is a power of two (the kernels' tiles: the
    runner's attention function checks that). On the
    CPU only under Triton's interpreter, asked for by ``TRITON_INTERPRET=1``
    and ``GENLM_EXACT_FUSED=1`` (how the kernels are tested without a GPU).
    """
    if not _triton_installed():
        return False
    if device.type == "cuda":
        return True
    return (
        device.type == "cpu"
        and os.environ.get("TRITON_INTERPRET") == "1"
        and os.environ.get("GENLM_EXACT_FUSED") == "1"
    )


def exp_of_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``exp(a - b)`` (float32, ``a``'s shape), each element's bits independent of the tensor's size.

    Computed in a buffer whose length torch splits in whole vectorized steps
    (:func:`aligned_numel`), so no element goes through the scalar loop.
    """
    shape = torch.broadcast_shapes(a.shape, b.shape)
    numel = shape.numel()
    buffer = torch.empty(
        aligned_numel(numel, torch.get_num_threads()), dtype=torch.float32, device=a.device
    )
    out = buffer[:numel].view(shape)
    torch.sub(a, b, out=out)
    if a.device.type == "cpu":
        buffer[numel:].zero_()
        buffer.exp_()
    else:
        out.exp_()
    return out


def sum_in_halves(x: torch.Tensor, dim: int, in_place: bool = False) -> torch.Tensor:
    """The sum over ``dim`` in a fixed tree: as if padded with zeros to a power of two, halves
    added until one is left.

    Zeros past a query's blocks only add exact zeros to its sums, so the
    result for a query does not depend on how many blocks the pass has
    (torch's own reductions group the terms by the dimension's length).
    With ``in_place``, the halves are added into ``x`` itself (the same sums;
    ``x`` is left holding partial sums).
    """
    dim = dim % x.dim()
    size = x.shape[dim]
    half = 1 << max(0, size - 1).bit_length()
    while half > 1:
        half //= 2
        if size > half and in_place:
            paired = size - half
            x.narrow(dim, 0, paired).add_(x.narrow(dim, half, paired))
            x, size = x.narrow(dim, 0, half), half
        elif size > half:  # element i gets element i + half (a padding zero beyond size)
            shape = list(x.shape)
            shape[dim] = half
            summed = x.new_empty(shape)
            paired = size - half
            torch.add(
                x.narrow(dim, 0, paired),
                x.narrow(dim, half, paired),
                out=summed.narrow(dim, 0, paired),
            )
            if paired < half:
                summed.narrow(dim, paired, half - paired).copy_(
                    x.narrow(dim, paired, half - paired)
                )
            x, size = summed, half
    return x.narrow(dim, 0, 1).squeeze(dim)


def span_sums(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sums of each :data:`SPAN_BLOCKS` blocks along ``dim``, each by :func:`sum_in_halves`
    (a last span of fewer blocks as if padded with zero blocks)."""
    dim = dim % x.dim()
    size = x.shape[dim]
    whole = size - size % SPAN_BLOCKS
    parts = []
    if whole:
        spans = x.narrow(dim, 0, whole).unflatten(dim, (-1, SPAN_BLOCKS))
        parts.append(sum_in_halves(spans, dim + 1))
    if whole < size:
        parts.append(sum_in_halves(x.narrow(dim, whole, size - whole), dim).unsqueeze(dim))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def pad_rows(x: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """``x`` with zero rows appended along ``dim`` up to :data:`MIN_ROWS` (``x`` itself when it has as many)."""
    num_rows = x.shape[dim]
    if num_rows >= MIN_ROWS:
        return x
    shape = list(x.shape)
    shape[dim] = MIN_ROWS - num_rows
    return torch.cat([x, x.new_zeros(shape)], dim=dim)
