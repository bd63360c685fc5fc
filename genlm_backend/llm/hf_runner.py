"""Batched next-token forward passes of a transformers model, reusing cached prefixes.

No asyncio here: :meth:`HFRunner.logprobs` takes distinct contexts and
returns a ``[B, V]`` tensor. For each context it looks up the longest cached
prefix in a :class:`~genlm_backend.cache.kv_tree.KVPrefixTree`, runs the model
over the remaining tokens only, and leaves the new keys/values in the tree.

Layout of one forward pass (``P`` = longest reused prefix, ``K`` = most new
tokens, row ``i`` reuses ``r_i`` and computes ``k_i`` tokens)::

    slot:   0 .......... P-r_i ...... P ........ P+k_i ...... P+K
    row i:  [ unused    | reused past | new tokens | padding    ]

The past is copied into a transformers ``StaticCache`` of length ``P + K``;
the model writes the new keys/values into slots ``[P, P + K)`` in place, and
the cache's tensors become the block the new entries point into. A 4-D mask
lets each row see exactly its own past and new tokens; position ids continue
each row's own positions.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import StaticCache

from genlm_backend.cache.kv_tree import KVBlock, KVEntry, KVPrefixTree


@dataclass
class _Row:
    """One context of a batch: reuse ``reused`` tokens of ``entry``, compute the rest."""

    index: int
    context: tuple[int, ...]
    entry: KVEntry | None
    reused: int

    @property
    def num_new(self) -> int:
        return len(self.context) - self.reused


class HFRunner:
    """Turns batches of contexts into next-token log-probabilities with KV-prefix reuse.

    Args:
        model: A transformers causal LM in eval mode (full-attention layers).
        kv_tree: Where keys/values are looked up and left.
        vocab_size: Columns of the output (the tokenizer's vocabulary): extra
            logit columns are dropped, missing ones are ``-inf``.
    """

    def __init__(self, model, kv_tree: KVPrefixTree, vocab_size: int):
        self.model = model
        self.kv_tree = kv_tree
        self.vocab_size = vocab_size
        self.num_tokens_computed = 0
        self._max_positions = _max_positions(model.config)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def logprobs(self, contexts: Sequence[tuple[int, ...]], namespace: Hashable = None) -> torch.Tensor:
        """Log-probabilities of the next token after each context.

        Returns:
            ``float32`` ``[len(contexts), vocab_size]`` on the model's device, normalized per row.
        """
        rows = [self._plan(i, context, namespace) for i, context in enumerate(contexts)]
        out = torch.empty(len(rows), self.vocab_size, dtype=torch.float32, device=self.device)
        # Rows extending a cached context by one token (the SMC step) go together;
        # longer computations are batched apart so they do not pad the short ones.
        computed = []
        for group in (
            [row for row in rows if row.num_new == 1],
            [row for row in rows if row.num_new > 1],
        ):
            if group:
                logprobs, block, num_past = self._forward(group)
                out[[row.index for row in group]] = logprobs
                computed.append((group, block, num_past))
        # Keys/values enter the tree only once every pass succeeded: a failed batch leaves nothing.
        for group, block, num_past in computed:
            self._keep(group, block, num_past, namespace)
        return out

    def _plan(self, index: int, context: tuple[int, ...], namespace: Hashable) -> _Row:
        entry, shared = self.kv_tree.longest_prefix(context, namespace)
        reused = min(shared, len(context) - 1)  # the last token must run to give logits
        return _Row(index, context, entry if reused > 0 else None, reused)

    def _forward(self, rows: list[_Row]) -> tuple[torch.Tensor, KVBlock, int]:
        num_new = max(row.num_new for row in rows)
        block = _extendable_block(rows, num_new)
        if block is not None:
            num_past = rows[0].entry.start + rows[0].reused  # the slot every new token goes to
            cache = self._cache_over(block, num_past)
        else:
            num_past = max(row.reused for row in rows)
            cache = self._cache_with_pasts(rows, num_past, num_new)
            block = KVBlock([(layer.keys, layer.values) for layer in cache.layers])
        input_ids, position_ids = self._inputs(rows, num_past, num_new)
        last = torch.tensor([row.num_new - 1 for row in rows], device=self.device)
        with _grouped_kv_attention(self.model), _head_sees_only(self.model, last if num_new > 1 else None):
            output = self.model(
                input_ids=input_ids,
                attention_mask=self._mask(rows, num_past, num_new, block.num_slots),
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=num_new if num_new > 1 else 1,
            )
        # logits: [B, 1, V_model] (or [B, num_new, V_model] for a head the hook cannot reach)
        logits = output.logits[:, 0] if output.logits.shape[1] == 1 else output.logits[
            torch.arange(len(rows), device=self.device), last
        ]
        self.num_tokens_computed += sum(row.num_new for row in rows)
        return self._normalize(logits), block, num_past

    def _cache_with_pasts(self, rows: list[_Row], num_past: int, num_new: int) -> StaticCache:
        """A StaticCache of ``num_past + num_new`` slots with each row's past right-aligned at ``num_past``."""
        config = self.model.config
        # One-token steps get spare slots, so the next steps can write in place (see _extendable_block).
        num_spare = _num_spare_slots(num_past) if num_new == 1 else 0
        num_slots = min(num_past + num_new + num_spare, self._max_positions)
        cache = StaticCache(config=config, max_cache_len=num_slots)
        num_kv_heads, head_dim = _kv_shape(config)
        shape = (len(rows), num_kv_heads, num_slots, head_dim)
        self.kv_tree.reserve(
            _block_nbytes(cache, len(rows), num_kv_heads, num_slots, head_dim, self.model.dtype),
            pinned=[row.entry for row in rows if row.entry is not None],
        )
        copies = _group_copies(rows, self.device)
        unwritten = [(i, num_past - row.reused) for i, row in enumerate(rows) if row.reused < num_past]
        for layer_index, layer in enumerate(cache.layers):
            # Every slot is written below or by the forward pass itself; only the
            # left padding is zeroed (masked, but it must not hold NaN bit patterns).
            keys = torch.empty(shape, dtype=self.model.dtype, device=self.device)
            values = torch.empty(shape, dtype=self.model.dtype, device=self.device)
            for (block, start, reused), (sources, targets) in copies.items():
                block_keys, block_values = block.layers[layer_index]
                past = slice(num_past - reused, num_past)
                _copy_rows(keys, targets, past, block_keys, sources, slice(start, start + reused))
                _copy_rows(values, targets, past, block_values, sources, slice(start, start + reused))
            for i, num_padding in unwritten:
                keys[i, :, :num_padding] = 0
                values[i, :, :num_padding] = 0
            keys[:, :, num_past + num_new :] = 0  # spare slots: masked, but read by attention
            values[:, :, num_past + num_new :] = 0
            _adopt(layer, keys, values, num_past)
        return cache

    def _cache_over(self, block: KVBlock, num_past: int) -> StaticCache:
        """A StaticCache whose layers are ``block``'s tensors, the next token going to slot ``num_past``."""
        cache = StaticCache(config=self.model.config, max_cache_len=block.num_slots)
        for layer, (keys, values) in zip(cache.layers, block.layers):
            _adopt(layer, keys, values, num_past)
        return cache

    def _inputs(self, rows: list[_Row], num_past: int, num_new: int):
        input_ids = torch.zeros(len(rows), num_new, dtype=torch.long)
        position_ids = torch.zeros(len(rows), num_new, dtype=torch.long)
        for i, row in enumerate(rows):
            new = row.context[row.reused :]
            input_ids[i, : len(new)] = torch.tensor(new)
            positions = torch.arange(row.reused, row.reused + num_new)
            position_ids[i] = positions.clamp_(max=self._max_positions - 1)  # padding stays in range
        return input_ids.to(self.device), position_ids.to(self.device)

    def _mask(self, rows: list[_Row], num_past: int, num_new: int, num_slots: int) -> torch.Tensor:
        """Additive mask ``[B, 1, num_new, num_slots]``: each row sees its past and its causal new tokens."""
        slots = torch.arange(num_slots)
        queries = torch.arange(num_new)[:, None] + num_past  # slot of each query
        first = torch.tensor([num_past - row.reused for row in rows])[:, None, None]
        visible = (slots[None, None, :] >= first) & (slots[None, None, :] <= queries[None])
        mask = torch.zeros(len(rows), 1, num_new, num_slots, dtype=self.model.dtype)
        mask.masked_fill_(~visible[:, None], torch.finfo(self.model.dtype).min)
        return mask.to(self.device)

    def _keep(self, rows: list[_Row], block: KVBlock, num_past: int, namespace: Hashable) -> None:
        """Leave each row's keys/values (past and new) in the tree, if the budget allows."""
        if block.num_live_entries == 0 and not self.kv_tree.reserve(block.nbytes):
            return
        for i, row in enumerate(rows):
            start = num_past - row.reused
            block.row_ends[i] = start + len(row.context)
            self.kv_tree.insert(row.context, KVEntry(block, i, start, len(row.context)), namespace)

    def _normalize(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        num_columns = logits.shape[-1]
        if num_columns > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        elif num_columns < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - num_columns), value=float("-inf"))
        return torch.log_softmax(logits, dim=-1)

    @torch.inference_mode()
    def logprobs_uncached(self, context: Sequence[int]) -> torch.Tensor:
        """Reference: one plain forward pass over the whole context, no cache involved."""
        input_ids = torch.tensor([list(context)], device=self.device)
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        return self._normalize(logits)[0]


@contextmanager
def _head_sees_only(model, last: torch.Tensor | None):
    """While active, the output head gets each row's hidden state at ``last[row]`` only.

    Rows end at different new positions, so the model is asked for logits at
    every new position; without this the head would compute ``[B, K, V]``
    logits (``B * K * V`` floats, gigabytes for long prompts) to keep ``B`` rows.
    The hook sits on the head module, so whatever the model does after it
    (soft-capping, scaling) still applies. ``last=None`` leaves the head alone.
    """
    head = model.get_output_embeddings() if last is not None else None
    if head is None:
        yield
        return

    def gather_last(module, args):
        hidden = args[0]  # [B, K, H] -> [B, 1, H]
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return (hidden[rows, last][:, None], *args[1:])

    handle = head.register_forward_pre_hook(gather_last)
    try:
        yield
    finally:
        handle.remove()


_GROUPED_SDPA = "genlm_sdpa_grouped_kv"


def _sdpa_grouped_kv(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' ``sdpa`` attention, except that masked grouped-query attention on CPU keeps its heads grouped.

    With any mask, transformers repeats each key/value head once per query
    head it serves before calling SDPA (CUDA's fused kernels take no mask with
    grouped heads). That repeat copies every key and value of the batch in every
    layer: about two thirds of a one-token step of 64 SmolLM2 rows over 130
    cached tokens (``benchmarks/bench_attention.py``). On CPU, ``scaled_dot_product_attention(..., enable_gqa=True)``
    takes a mask and gives the same result without the copy. Every other case
    is handed to transformers' function unchanged.
    """
    plain = (
        attention_mask is None
        or query.device.type != "cpu"
        or query.shape[1] == key.shape[1]
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("output_attentions")
    )
    if plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


@contextmanager
def _grouped_kv_attention(model):
    """While active, a model using transformers' ``sdpa`` attention uses :func:`_sdpa_grouped_kv` instead."""
    config = model.config.get_text_config(decoder=True)
    if config._attn_implementation != "sdpa":
        yield
        return
    _register_grouped_sdpa()
    config._attn_implementation = _GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


@functools.cache
def _register_grouped_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_GROUPED_SDPA, _sdpa_grouped_kv)
    AttentionMaskInterface.register(_GROUPED_SDPA, sdpa_mask)


def _num_spare_slots(num_past: int) -> int:
    """Room left in a one-token step's block for later steps: 1/4 of its length, at least 8."""
    return max(8, num_past // 4)


def _extendable_block(rows: list[_Row], num_new: int) -> KVBlock | None:
    """The block to extend in place, if this is the next one-token step of exactly its rows.

    True when every row ``i`` extends, by one token, the whole context held by
    row ``i`` of one block; those contexts all end at the same slot, which is
    their row's last written slot (so the slot written now belongs to no other
    entry), and a free slot is left. That is the SMC step without resampling;
    anything else is copied into a new block.
    """
    first = rows[0].entry
    if num_new != 1 or first is None:
        return None
    block, end = first.block, first.start + first.length
    if len(block.row_ends) != len(rows) or end >= block.num_slots:
        return None
    for i, row in enumerate(rows):
        entry = row.entry
        if (
            entry is None or entry.block is not block or entry.row != i
            or row.reused != entry.length or entry.start + entry.length != end or block.row_ends[i] != end
        ):
            return None
    return block


def _group_copies(rows: list[_Row], device) -> dict:
    """Rows whose pasts sit at the same slots of the same block, copied with one indexed copy per layer.

    In an SMC step every particle extends a row of the previous batch, so
    this is usually one group: 2 copies per layer instead of 2 per row and layer.
    """
    groups: dict[tuple, tuple[list[int], list[int]]] = {}
    for i, row in enumerate(rows):
        if row.reused:
            key = (row.entry.block, row.entry.start, row.reused)
            sources, targets = groups.setdefault(key, ([], []))
            sources.append(row.entry.row)
            targets.append(i)
    return {
        key: (_as_index(sources, device), _as_index(targets, device))
        for key, (sources, targets) in groups.items()
    }


def _as_index(rows: list[int], device) -> slice | torch.Tensor:
    """A slice for consecutive rows (a plain strided copy), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _copy_rows(target, target_rows, target_slots: slice, source, source_rows, source_slots: slice) -> None:
    """``target[target_rows, :, target_slots] = source[source_rows, :, source_slots]`` without temporaries where possible."""
    if isinstance(target_rows, slice) and isinstance(source_rows, slice):
        target[target_rows, :, target_slots].copy_(source[source_rows, :, source_slots])
    else:
        target[target_rows, :, target_slots] = source[source_rows, :, source_slots]


def _adopt(layer, keys: torch.Tensor, values: torch.Tensor, num_filled: int) -> None:
    """Make a StaticCache layer use ``keys``/``values`` (``[B, H, T, D]``), ``num_filled`` slots already written.

    Sets what ``StaticLayer.lazy_initialization`` sets, without its zero-filled
    allocation: the runner writes or zeroes every slot itself.
    """
    layer.dtype, layer.device = keys.dtype, keys.device
    layer.batch_size, layer.num_heads = keys.shape[:2]
    layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
    layer.keys, layer.values = keys, values
    layer.cumulative_length = torch.tensor(num_filled, dtype=torch.long, device=keys.device)
    layer.is_initialized = True


def _kv_shape(config) -> tuple[int, int]:
    text = config.get_text_config(decoder=True)
    num_heads = getattr(text, "num_attention_heads", None) or text.n_head
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return num_kv_heads, head_dim


def _max_positions(config) -> int:
    text = config.get_text_config(decoder=True)
    return getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 1 << 30


def _block_nbytes(cache, batch, heads, slots, head_dim, dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * len(cache.layers) * batch * heads * slots * head_dim * element
