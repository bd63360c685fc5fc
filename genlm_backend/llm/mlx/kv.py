"""Keys/values of MLX batches, and the cache object mlx-lm's attention layers write and read through.

An :class:`MlxKVBlock` holds every layer's keys and values of one batch;
the :class:`~genlm_backend.cache.kv_tree.KVPrefixTree` keeps entries over its
rows exactly as it does for transformers blocks (it reads only a block's slot
bookkeeping). A :class:`BatchView` is one layer's view of a forward pass for
mlx-lm: where the new keys/values go in the block, each row's positions, and
which slots each query sees; when rows read cached prefixes held elsewhere
(the plan's levels: a prompt), its ``attend`` reads each once for all its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from genlm_backend.cache.kv_block import KVBlock, Piece, Segment
from genlm_backend.llm.mlx.compat import SharedPrefixCache


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one layer's keys and values, per row and slot."""

    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    dtype: mx.Dtype

    def nbytes(self, num_rows: int, num_slots: int) -> int:
        """Bytes of a block of ``num_rows`` rows and ``num_slots`` slots."""
        per_slot = self.num_kv_heads * (self.key_dim + self.value_dim) * self.dtype.size
        return self.num_layers * num_rows * num_slots * per_slot


class MlxKVBlock(KVBlock):
    """Every layer's keys ``[B, H, T, Dk]`` and values ``[B, H, T, Dv]`` of one batch, as MLX arrays.

    One array per layer and kind, so that a step writing one slot per row
    updates each in place (MLX reuses an array's buffer when nothing else
    holds it). The slot bookkeeping (``row_ends``, ``num_live_entries``,
    ``nbytes``) is :class:`~genlm_backend.cache.kv_block.KVBlock`'s; its
    torch storage (``stacked``, ``layers``) is not used.
    """

    def __init__(self, keys: list[mx.array], values: list[mx.array]):
        # Not KVBlock.__init__: that one takes a torch tensor.
        self.keys = keys
        self.values = values
        self.nbytes = sum(array.nbytes for array in keys + values)
        self.num_live_entries = 0
        num_rows, _, num_slots, _ = keys[0].shape
        self.row_ends = [0] * num_rows
        self.num_rows = num_rows
        self.num_slots = num_slots

    @classmethod
    def zeros(cls, layout: KVLayout, num_rows: int, num_slots: int) -> MlxKVBlock:
        """A block of ``num_rows`` rows and ``num_slots`` zeroed slots."""
        heads = (num_rows, layout.num_kv_heads, num_slots)
        keys = [mx.zeros((*heads, layout.key_dim), layout.dtype) for _ in range(layout.num_layers)]
        values = [
            mx.zeros((*heads, layout.value_dim), layout.dtype) for _ in range(layout.num_layers)
        ]
        return cls(keys, values)

    def arrays(self) -> list[mx.array]:
        """Every array of the block (to evaluate after writing)."""
        return self.keys + self.values

    def copy_in(self, copies) -> None:
        """Copy each ``(row, slot, segment)``'s keys/values into this block's ``row`` from ``slot`` on."""
        for row, slot, segment in copies:
            for layer in range(len(self.keys)):
                keys, values = span(segment, layer)
                self.keys[layer][row, :, slot : slot + segment.length] = keys
                self.values[layer][row, :, slot : slot + segment.length] = values


def span(segment: Segment, layer: int) -> tuple[mx.array, mx.array]:
    """Keys and values ``[H, length, D]`` of ``segment``'s slots at ``layer``."""
    block = segment.block
    assert isinstance(block, MlxKVBlock), "MLX entries live in MLX blocks"
    stop = segment.start + segment.length
    return (
        block.keys[layer][segment.row, :, segment.start : stop],
        block.values[layer][segment.row, :, segment.start : stop],
    )


def piece_span(piece: Piece, layer: int) -> tuple[mx.array, mx.array]:
    """Keys and values ``[H, n, D]`` of a piece: the first ``n`` slots of an entry's own span."""
    entry, n = piece
    return span(Segment(entry.block, entry.row, entry.start, n), layer)


class ForwardPass:
    """What every layer's :class:`BatchView` of one forward pass shares.

    Args:
        block: Where the new keys/values go.
        num_past: The slot the first new token of every row goes to.
        num_new: New tokens per row in this pass (rows with fewer are padded after theirs).
        positions: ``[B]`` int32, position of each row's first new token.
        own_start: ``[B]`` int32, each row's first slot in ``block`` (its own past starts there).
        levels: Cached prefixes read in place, each with the rows that read it
            (``None``: every row), in the order the rows' contexts have them.
    """

    def __init__(
        self,
        block: MlxKVBlock,
        num_past: int,
        num_new: int,
        positions: mx.array,
        own_start: mx.array,
        levels: list[tuple[Piece, list[int] | None]],
    ):
        self.block = block
        self.num_past = num_past
        self.num_new = num_new
        self.positions = positions
        num_rows = len(block.row_ends)
        self.levels = [
            (piece, None if rows is None else mx.array([i in rows for i in range(num_rows)]))
            for piece, rows in levels
        ]
        # mask: [B, 1, L, S]: row b's query j sees slots own_start[b] .. num_past + j.
        slots = mx.arange(num_past + num_new)[None, None, None, :]
        queries = mx.arange(num_past, num_past + num_new)[None, None, :, None]
        self.mask = (own_start[:, None, None, None] <= slots) & (slots <= queries)
        self.num_shared_reads = 0

    def views(self) -> list[BatchView]:
        """One cache object per layer, for ``model(inputs, cache=...)``."""
        return [BatchView(self, layer) for layer in range(len(self.block.keys))]


class BatchView(SharedPrefixCache):
    """mlx-lm's cache protocol for one layer of a :class:`ForwardPass` (``offset``, ``update_and_fetch``, ``make_mask``)."""

    def __init__(self, forward: ForwardPass, layer: int):
        self.forward = forward
        self.layer = layer

    @property
    def offset(self) -> mx.array:
        """``[B]``: the position of each row's first new token (RoPE reads it)."""
        return self.forward.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the new ``[B, H, L, D]`` keys/values at slot ``num_past``; return every slot up to them."""
        forward, layer = self.forward, self.layer
        start, stop = forward.num_past, forward.num_past + keys.shape[2]
        forward.block.keys[layer][:, :, start:stop] = keys
        forward.block.values[layer][:, :, start:stop] = values
        return forward.block.keys[layer][:, :, :stop], forward.block.values[layer][:, :, :stop]

    def make_mask(self, num_queries: int, return_array: bool = False, window_size=None) -> mx.array:
        """``[B, 1, L, S]`` bool: which of the block's slots each query sees (the levels aside)."""
        return self.forward.mask

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask):
        """Softmax attention over the levels, then the block's own slots, in one normalization.

        ``queries`` ``[B, Hq, L, D]``; each level's keys/values ``[Hkv, n, D]``
        are read once for every row (the rows fold into the query axis), so
        no row holds a copy; a row that does not read a level gets ``-inf``
        scores there. Returns ``[B, Hq, L, Dv]``.
        """
        forward = self.forward
        if not forward.levels:
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=forward.mask
            )
        forward.num_shared_reads += 1
        batch, num_heads, length, dim = queries.shape
        num_kv_heads = keys.shape[1]
        group = num_heads // num_kv_heads
        # q: [B, Hkv, g, L, D]; folded: [Hkv, B*g*L, D]
        q = (queries * scale).reshape(batch, num_kv_heads, group, length, dim)
        folded = q.transpose(1, 0, 2, 3, 4).reshape(num_kv_heads, -1, dim)
        scores, shared_values = [], []
        for piece, rows in forward.levels:
            shared_keys, level_values = piece_span(piece, self.layer)
            level_scores = (folded @ shared_keys.swapaxes(-1, -2)).reshape(
                num_kv_heads, batch, group, length, -1
            )
            level_scores = level_scores.transpose(1, 0, 2, 3, 4)  # [B, Hkv, g, L, n]
            if rows is not None:
                level_scores = mx.where(rows[:, None, None, None, None], level_scores, -mx.inf)
            scores.append(level_scores)
            shared_values.append(level_values)
        own_scores = q @ keys[:, :, None].swapaxes(-1, -2)  # [B, Hkv, g, L, S]
        scores.append(mx.where(forward.mask[:, :, None], own_scores, -mx.inf))
        probs = mx.softmax(mx.concatenate(scores, axis=-1).astype(mx.float32), axis=-1)
        probs = probs.astype(values.dtype)
        out = probs[..., -own_scores.shape[-1] :] @ values[:, :, None]  # [B, Hkv, g, L, Dv]
        start = 0
        for level_values in shared_values:
            n = level_values.shape[1]
            level_probs = probs[..., start : start + n].transpose(1, 0, 2, 3, 4)
            level_out = (level_probs.reshape(num_kv_heads, -1, n) @ level_values).reshape(
                num_kv_heads, batch, group, length, -1
            )
            out = out + level_out.transpose(1, 0, 2, 3, 4)
            start += n
        return out.reshape(batch, num_heads, length, -1)
