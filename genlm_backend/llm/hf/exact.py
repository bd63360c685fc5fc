"""Exact rows: a context's row has the same bits whatever shares its pass and whatever the cache holds.

What makes a row depend on its neighbours in a plain forward pass, and what this module does about it:

* **Matrix products of few rows.** torch's CPU products give a row other
  bits when the product has fewer than a few rows (measured on torch 2.13:
  1 to 3 rows, and 7 on two threads) than in any product of 16 rows or more,
  where a row's bits depend neither on the other rows nor on its position.
  :class:`PaddedMatmuls` pads every projection's input to 16 rows.
  cuBLAS picks its kernel by the row count: a float32 row got other bits
  beside 16 to 127 others than alone (an H100, torch 2.11). On CUDA every
  product is computed in pieces of :data:`CUDA_ROWS` rows, one kernel shape
  whatever the pass holds; rows are exact there in bfloat16
  (:func:`exact_rows_unsupported`).
* **Attention's reduction order.** A fused kernel splits the keys into
  blocks whose size depends on the number of keys and queries, and the
  runner's cascade merges a cached prefix with the rest at the prefix's
  end. :func:`exact_attention` splits every query's keys at fixed positions
  (``0, b, 2b, ...``, ``b = BLOCK_TOKENS``), weighs every key by
  ``exp(score - top)``, ``top`` the query's highest score over its whole
  context (an exact maximum, whatever the order), computes each block with the
  same products (16 query rows or more, ``b`` keys, masked keys weighing an
  exact zero, operands in one memory layout), sums each span of
  :data:`SPAN_BLOCKS` blocks, then the spans, with sums of a fixed shape
  (:func:`span_sums`, :func:`sum_in_halves`). A block is computed from
  wherever the tree holds its keys: a level held once for many rows (the
  planner's levels start and end at span boundaries:
  ``LevelPolicy.block_tokens``, so a level's spans are summed once for all
  its readers), or the row's own part. A captured one-token step lays the
  same computation out on the device from the step's inputs
  (:meth:`ExactLayout.of_step`).
* **Elementwise ``exp``.** torch computes the elements past a range's last
  whole vectorized step in a scalar loop that rounds otherwise, and where a
  range ends depends on the tensor's size: :func:`exp_of_difference`.

Everything else a decoder layer does is per row: embeddings, norms, rotary
embeddings, activations, the log-softmax; except, on CUDA, a norm's mean,
whose reduction splits a row among more threads when a pass has few rows
(computed one row per program there: ``exact_fused.RowMeans``).

Each device computes exact attention in one fixed order over the same
:class:`ExactLayout`, chosen by the runner's attention function
(``compat._exact_attention``): on the CPU span by span through torch's fused
CPU attention kernel (:mod:`~genlm_backend.llm.hf.exact_spans`); on CUDA,
where Triton is installed, in :mod:`~genlm_backend.llm.hf.exact_fused`'s
kernels (:func:`uses_fused_kernels`); elsewhere, and on CUDA for head sizes
that are not powers of two, in :func:`exact_attention`'s torch operations.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from genlm_backend.cache import plan as planner
from genlm_backend.cache.plan import PassPlan
from genlm_backend.llm.hf.attention import Level

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
    :mod:`~genlm_backend.llm.hf.exact_fused` (another fixed order than :func:`exact_attention`'s
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
    :mod:`~genlm_backend.llm.hf.exact_spans`; empty for a captured step's layout)."""
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
        starts = planner.row_starts(plan)
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


class PaddedMatmuls:
    """While :attr:`active`, every projection of ``model`` (``nn.Linear``, transformers' ``Conv1D``)
    computes a row with products whose shape does not depend on the other rows.

    On the CPU a product of fewer than :data:`MIN_ROWS` rows is padded with
    zeros to that many (the extra outputs dropped). With ``pieces`` (on CUDA),
    a plain ``nn.Linear`` or ``Conv1D`` computes its rows in pieces of exactly
    :data:`CUDA_ROWS` rows: the module itself is handed no rows, and its output
    is the pieces' products.

    The hooks stay on the modules; :meth:`attach` puts them on modules added since (an adapter's).
    One per model (:meth:`of`), however many runners it serves.
    """

    def __init__(self, pieces: bool = False):
        self.active = False
        self.pieces = pieces
        self.device: str | None = None
        """The device type of the model's weights when :meth:`of` last looked."""
        self._hooked: set[int] = set()
        self._shapes: dict[int, torch.Size] = {}
        self._inputs: dict[int, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = {}

    @classmethod
    def of(cls, model: torch.nn.Module) -> PaddedMatmuls:
        """The model's own, its projections hooked (products in pieces where its weights are on CUDA)."""
        device = next(model.parameters()).device.type
        padded = _PADDED.get(model)
        if padded is None:
            padded = _PADDED[model] = cls(pieces=device == "cuda")
        if padded.device != device:  # made here, or the model moved since
            padded.device, padded.pieces = device, device == "cuda"
        padded.attach(model)
        return padded

    def attach(self, model: torch.nn.Module) -> None:
        """Hook the projections of ``model`` not hooked yet.

        Raises:
            ValueError: with ``pieces``, a projection whose product is not a plain
                ``nn.Linear``'s or ``Conv1D``'s (a quantized layer, say).
        """
        projections = [module for module in model.modules() if _is_projection(module)]
        for module in projections if self.pieces else ():
            if _product_of(module) is None:
                raise ValueError(
                    f"deterministic=True on CUDA computes projections in pieces, which needs plain "
                    f"nn.Linear or Conv1D layers; this model has a {type(module).__name__}"
                )
        for module in projections:
            if id(module) in self._hooked:
                continue
            module.register_forward_pre_hook(self._pad)
            module.register_forward_hook(self._unpad)
            self._hooked.add(id(module))

    def _pad(self, module, args):
        if not self.active:
            return None
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        self._shapes.pop(id(module), None)  # left by a pass that raised
        self._inputs.pop(id(module), None)
        product = _product_of(module) if self.pieces else None
        if product is not None:
            self._shapes[id(module)] = x.shape
            self._inputs[id(module)] = (product, rows)
            return (rows[:0], *args[1:])
        if rows.shape[0] >= MIN_ROWS:
            return None
        self._shapes[id(module)] = x.shape
        return (pad_rows(rows), *args[1:])

    def _unpad(self, module, args, output):
        shape = self._shapes.pop(id(module), None)
        if shape is None:
            return None
        pending = self._inputs.pop(id(module), None)
        num_rows = shape[:-1].numel()
        if pending is not None:
            output = products_in_pieces(*pending)
        return output[:num_rows].reshape(*shape[:-1], output.shape[-1])


def products_in_pieces(product, rows: torch.Tensor) -> torch.Tensor:
    """``product(rows)`` computed :data:`CUDA_ROWS` rows at a time (the last piece padded with zeros)."""
    num_rows = rows.shape[0]
    if num_rows == 0:
        return product(rows)
    padded = -(-num_rows // CUDA_ROWS) * CUDA_ROWS
    if padded != num_rows:
        rows = torch.cat([rows, rows.new_zeros(padded - num_rows, rows.shape[1])])
    if padded == CUDA_ROWS:  # a step of up to CUDA_ROWS rows: one product, no copy
        return product(rows)[:num_rows]
    return torch.cat([product(piece) for piece in rows.split(CUDA_ROWS)])[:num_rows]


def _product_of(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The product a plain projection computes, as a function of its input rows (``None`` for others)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if type(module) is torch.nn.Linear and isinstance(weight, torch.Tensor):
        return lambda rows: torch.nn.functional.linear(rows, weight, bias)
    if type(module).__name__ != "Conv1D" or not isinstance(weight, torch.Tensor):
        return None
    if isinstance(bias, torch.Tensor) and weight.dim() == 2:
        return lambda rows: torch.addmm(bias, rows, weight)
    return None


_PADDED: weakref.WeakKeyDictionary[torch.nn.Module, PaddedMatmuls] = weakref.WeakKeyDictionary()


def _is_projection(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
