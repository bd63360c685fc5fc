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

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from transformers import StaticCache

from genlm_backend.cache.kv_tree import KVBlock, KVEntry, KVPrefixTree
from genlm_backend.llm.hf_adapters import PeftAdapters
from genlm_backend.llm.hf_compat import (
    adopt,
    cache_nbytes,
    check_transformers_version,
    grouped_kv_attention,
    head_sees_only,
    kv_shape,
    max_positions,
)
from genlm_backend.llm.runner import Adapter, Request, RunnerStats, fit_to_vocab, group_by_adapter


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
    """Turns batches of requests into next-token log-probabilities with KV-prefix reuse.

    Requests are grouped by adapter; each group runs with its adapter active
    and its keys/values live under that adapter in the tree.

    Args:
        model: A transformers causal LM in eval mode (full-attention layers).
        kv_tree: Where keys/values are looked up and left.
        vocab_size: Columns of the output (the tokenizer's vocabulary): extra
            logit columns are dropped, missing ones are ``-inf``.

    Raises:
        ImportError: the installed transformers is not a supported version.
    """

    def __init__(self, model, kv_tree: KVPrefixTree, vocab_size: int):
        check_transformers_version()
        self.adapters = PeftAdapters(model)
        self.kv_tree = kv_tree
        self.vocab_size = vocab_size
        self.num_tokens_computed = 0
        self._max_positions = max_positions(model.config)

    @property
    def model(self):
        """The model (a peft model once an adapter was loaded)."""
        return self.adapters.model

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def stats(self) -> RunnerStats:
        return RunnerStats(
            num_tokens_computed=self.num_tokens_computed, kv_cache_bytes=self.kv_tree.bytes_held
        )

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        """``[len(requests), vocab_size]`` float32 log-probabilities on the model's device."""
        out = torch.empty(len(requests), self.vocab_size, dtype=torch.float32, device=self.device)
        for adapter, positions in group_by_adapter(requests).items():
            with self.adapters.active(adapter):
                out[positions] = self.logprobs(
                    [requests[i].context for i in positions], namespace=adapter
                )
        return out

    @torch.inference_mode()
    def run_uncached(self, request: Request) -> torch.Tensor:
        """Reference: one plain forward pass over the whole context under its adapter, no cache involved."""
        input_ids = torch.tensor([list(request.context)], device=self.device)
        with self.adapters.active(request.adapter):
            logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        return fit_to_vocab(logits, self.vocab_size)[0]

    def load_adapter(self, adapter: Adapter) -> None:
        self.adapters.load(adapter)

    def unload_adapter(self, adapter: Adapter) -> None:
        self.kv_tree.drop_namespace(adapter)
        self.adapters.unload(adapter)

    def clear(self) -> None:
        self.kv_tree.clear()

    def close(self) -> None:
        self.kv_tree.clear()

    @torch.inference_mode()
    def logprobs(
        self, contexts: Sequence[tuple[int, ...]], namespace: Hashable = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token after each context, keys/values kept under ``namespace``.

        Runs the model as it is (activating an adapter is :meth:`run`'s job).

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
            placements = [(row.context, i, num_past - row.reused) for i, row in enumerate(group)]
            self.kv_tree.commit(block, placements, namespace)
        return out

    def _plan(self, index: int, context: tuple[int, ...], namespace: Hashable) -> _Row:
        entry, shared = self.kv_tree.longest_prefix(context, namespace)
        reused = min(shared, len(context) - 1)  # the last token must run to give logits
        return _Row(index, context, entry if reused > 0 else None, reused)

    def _forward(self, rows: list[_Row]) -> tuple[torch.Tensor, KVBlock, int]:
        num_new = max(row.num_new for row in rows)
        block = (
            self.kv_tree.extendable_block([(row.entry, row.reused) for row in rows])
            if num_new == 1
            else None
        )
        if block is not None:
            first = rows[0].entry
            assert first is not None  # an extendable block is some row's entry's
            num_past = first.start + rows[0].reused  # the slot every new token goes to
            cache = self._cache_over(block, num_past)
        else:
            num_past = max(row.reused for row in rows)
            cache = self._cache_with_pasts(rows, num_past, num_new)
            # Dynamic layers: keys and values exist once the cache was filled.
            block = KVBlock([(layer.keys, layer.values) for layer in cache.layers])  # type: ignore[union-attr,misc]
        input_ids, position_ids = self._inputs(rows, num_past, num_new)
        last = torch.tensor([row.num_new - 1 for row in rows], device=self.device)
        with (
            grouped_kv_attention(self.model),
            head_sees_only(self.model, last if num_new > 1 else None),
        ):
            output = self.model(
                input_ids=input_ids,
                attention_mask=self._mask(rows, num_past, num_new, block.num_slots),
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=max(1, num_new),
            )
        # logits: [B, 1, V_model] (or [B, num_new, V_model] for a head the hook cannot reach)
        logits = (
            output.logits[:, 0]
            if output.logits.shape[1] == 1
            else output.logits[torch.arange(len(rows), device=self.device), last]
        )
        self.num_tokens_computed += sum(row.num_new for row in rows)
        return fit_to_vocab(logits, self.vocab_size), block, num_past

    def _cache_with_pasts(self, rows: list[_Row], num_past: int, num_new: int) -> StaticCache:
        """A StaticCache of ``num_past + num_new`` slots with each row's past right-aligned at ``num_past``."""
        config = self.model.config
        # One-token steps get spare slots, so the next steps can write in place (see KVPrefixTree.extendable_block).
        num_spare = _num_spare_slots(num_past) if num_new == 1 else 0
        num_slots = min(num_past + num_new + num_spare, self._max_positions)
        cache = StaticCache(config=config, max_cache_len=num_slots)
        num_kv_heads, head_dim = kv_shape(config)
        shape = (len(rows), num_kv_heads, num_slots, head_dim)
        self.kv_tree.reserve(
            cache_nbytes(cache, len(rows), num_kv_heads, num_slots, head_dim, self.model.dtype),
            pinned=[row.entry for row in rows if row.entry is not None],
        )
        copies = _group_copies(rows, self.device)
        unwritten = [
            (i, num_past - row.reused) for i, row in enumerate(rows) if row.reused < num_past
        ]
        for layer_index, layer in enumerate(cache.layers):
            # Every slot is written below or by the forward pass itself; only the
            # left padding is zeroed (masked, but it must not hold NaN bit patterns).
            keys = torch.empty(shape, dtype=self.model.dtype, device=self.device)
            values = torch.empty(shape, dtype=self.model.dtype, device=self.device)
            for (block, start, reused), (sources, targets) in copies.items():
                block_keys, block_values = block.layers[layer_index]
                past = slice(num_past - reused, num_past)
                _copy_rows(keys, targets, past, block_keys, sources, slice(start, start + reused))
                _copy_rows(
                    values, targets, past, block_values, sources, slice(start, start + reused)
                )
            for i, num_padding in unwritten:
                keys[i, :, :num_padding] = 0
                values[i, :, :num_padding] = 0
            keys[:, :, num_past + num_new :] = 0  # spare slots: masked, but read by attention
            values[:, :, num_past + num_new :] = 0
            adopt(layer, keys, values, num_past)
        return cache

    def _cache_over(self, block: KVBlock, num_past: int) -> StaticCache:
        """A StaticCache whose layers are ``block``'s tensors, the next token going to slot ``num_past``."""
        cache = StaticCache(config=self.model.config, max_cache_len=block.num_slots)
        for layer, (keys, values) in zip(cache.layers, block.layers):
            adopt(layer, keys, values, num_past)
        return cache

    def _inputs(self, rows: list[_Row], num_past: int, num_new: int):
        input_ids = torch.zeros(len(rows), num_new, dtype=torch.long)
        position_ids = torch.zeros(len(rows), num_new, dtype=torch.long)
        for i, row in enumerate(rows):
            new = row.context[row.reused :]
            input_ids[i, : len(new)] = torch.tensor(new)
            positions = torch.arange(row.reused, row.reused + num_new)
            # Padding positions stay in the model's range.
            position_ids[i] = positions.clamp_(max=self._max_positions - 1)
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


def _num_spare_slots(num_past: int) -> int:
    """Room left in a one-token step's block for later steps: 1/4 of its length, at least 8."""
    return max(8, num_past // 4)


def _group_copies(rows: list[_Row], device) -> dict:
    """Rows whose pasts sit at the same slots of the same block, copied with one indexed copy per layer.

    In an SMC step every particle extends a row of the previous batch, so
    this is usually one group: 2 copies per layer instead of 2 per row and layer.
    """
    groups: dict[tuple, tuple[list[int], list[int]]] = {}
    for i, row in enumerate(rows):
        if row.reused:
            entry = row.entry
            assert entry is not None  # reused tokens come from an entry
            key = (entry.block, entry.start, row.reused)
            sources, targets = groups.setdefault(key, ([], []))
            sources.append(entry.row)
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


def _copy_rows(
    target, target_rows, target_slots: slice, source, source_rows, source_slots: slice
) -> None:
    """``target[target_rows, :, target_slots] = source[source_rows, :, source_slots]`` without temporaries where possible."""
    if isinstance(target_rows, slice) and isinstance(source_rows, slice):
        target[target_rows, :, target_slots].copy_(source[source_rows, :, source_slots])
    else:
        target[target_rows, :, target_slots] = source[source_rows, :, source_slots]
