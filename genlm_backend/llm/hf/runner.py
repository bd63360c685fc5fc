"""Batched next-token forward passes of a transformers model, reusing cached prefixes.

No asyncio here: :meth:`HFRunner.logprobs` takes distinct contexts and
returns a ``[B, V]`` tensor. For each context it looks up the longest cached
prefix in a :class:`~genlm_backend.cache.kv_tree.KVPrefixTree`, runs the model
over the remaining tokens only, and leaves the new keys/values in the tree.

Cached prefixes shared by rows (a long prompt in front of every particle)
stay where they are, held once, and the attention reads each once for all
its rows (:mod:`~genlm_backend.cache.plan` says which part of a row is
read where, :mod:`~genlm_backend.llm.hf.attention` computes it). The rest of
each row's past is copied into a new block, or the step writes in place
into the block it extends; a transformers ``StaticCache`` over the block's
tensors lets the model write the new keys/values there, and the new
entries point into it. A 4-D mask lets each row see exactly its own part; position ids
continue each row's own positions. Several contexts sharing a prefix that
is not cached yet get that prefix computed once first.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Hashable, Sequence

import torch

from genlm_backend.cache import plan as planner
from genlm_backend.cache.kv_tree import KVBlock, KVPrefixTree, Placement
from genlm_backend.cache.plan import BatchPlan, LevelPolicy, Lookup, PassPlan, plan_batch
from genlm_backend.llm.hf.attention import Cascade, Level
from genlm_backend.llm.hf.compat import (
    PeftAdapters,
    StaticCaches,
    cache_nbytes,
    check_transformers_version,
    grouped_kv_attention,
    head_sees_only,
    kv_shape,
    max_positions,
    shared_levels_unsupported,
)
from genlm_backend.llm.hf.exact import (
    SPAN_TOKENS,
    ExactLayout,
    PaddedMatmuls,
    exact_rows_unsupported,
    uses_fused_kernels,
)
from genlm_backend.llm.hf.graphs import StepGraphs
from genlm_backend.llm.runner import (
    Adapter,
    Request,
    RunnerStats,
    ScoreRequest,
    fit_to_vocab,
    group_by_adapter,
)


class HFRunner:
    """Turns batches of requests into next-token log-probabilities with KV-prefix reuse.

    Requests are grouped by adapter; each group runs with its adapter active
    and its keys/values live under that adapter in the tree.

    Args:
        model: A transformers causal LM in eval mode (full-attention layers).
        kv_tree: Where keys/values are looked up and left.
        vocab_size: Columns of the output (the tokenizer's vocabulary): extra
            logit columns are dropped, missing ones are ``-inf``.
        deterministic: Every row has the bits of its context computed alone
            from an empty cache, whatever shares its pass and whatever the tree
            holds (:mod:`~genlm_backend.llm.hf.exact`).

    Raises:
        ImportError: the installed transformers is not a supported version.
        ValueError: ``deterministic`` for a model whose attention the runner cannot
            compute itself, or on a device and dtype where rows are not exact
            (:func:`~genlm_backend.llm.hf.exact.exact_rows_unsupported`).
    """

    def __init__(self, model, kv_tree: KVPrefixTree, vocab_size: int, deterministic: bool = False):
        check_transformers_version()
        self.adapters = PeftAdapters(model)
        self.kv_tree = kv_tree
        self.vocab_size = vocab_size
        self.num_tokens_computed = 0
        self._max_positions = max_positions(model.config)
        self._static_cache = StaticCaches(model.config)
        self.levels_unsupported = shared_levels_unsupported(model)
        """Why shared prefixes are copied per row for this model (``None``: they are read once)."""
        self.deterministic = deterministic
        self._padded_matmuls: PaddedMatmuls | None = None
        if deterministic:
            if self.levels_unsupported is not None:
                raise ValueError(
                    f"deterministic=True needs attention the runner computes itself; this model's "
                    f"cannot be: {self.levels_unsupported}"
                )
            where = next(model.parameters())
            refused = exact_rows_unsupported(where.device, where.dtype)
            if refused is not None:
                raise ValueError(f"deterministic=True: {refused}")
            self._padded_matmuls = PaddedMatmuls.of(model)
        self.level_policy = LevelPolicy(
            enabled=self.levels_unsupported is None,
            block_tokens=SPAN_TOKENS if deterministic else None,
        )
        self.graphs = StepGraphs(
            lambda: self.model,
            self._static_cache,
            kv_tree,
            vocab_size,
            self._max_positions,
            exact=self._exact_products if deterministic else None,
        )
        """One-token steps captured as graphs (on CUDA), the rest eager: see :mod:`~genlm_backend.llm.hf.graphs`."""
        if self.levels_unsupported is not None:
            self.graphs.unsupported = f"shared levels unsupported: {self.levels_unsupported}"

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

    def request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget: the tokens it adds to a batch's working memory.

        With shared levels, that is the part of its context not cached yet (a
        particle behind a cached prompt costs its own tokens); without them,
        every token (each row holds its whole past). Called from the event
        loop while a batch may run, so the cached length is an estimate.
        """
        if not self.level_policy.enabled:
            return len(request.context)
        cached = self.kv_tree.cached_length(request.context, request.adapter, request.parent)
        return max(1, len(request.context) - cached)

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        """``[len(requests), vocab_size]`` float32 log-probabilities on the model's device."""
        groups = group_by_adapter(requests)
        if len(groups) == 1:  # one adapter: the rows are already in order
            ((adapter, _),) = groups.items()
            with self.adapters.active(adapter):
                return self.logprobs([request.context for request in requests], namespace=adapter)
        out = torch.empty(len(requests), self.vocab_size, dtype=torch.float32, device=self.device)
        for adapter, positions in groups.items():
            with self.adapters.active(adapter):
                out[positions] = self.logprobs(
                    [requests[i].context for i in positions], namespace=adapter
                )
        return out

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Each continuation scored from one forward pass over it, its context's keys/values reused."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(requests)
        for adapter, positions in group_by_adapter(requests).items():
            with self.adapters.active(adapter):
                scores = self.score_continuations(
                    [(requests[i].context, requests[i].continuation) for i in positions],
                    namespace=adapter,
                )
            for i, found in zip(positions, scores):
                out[i] = found
        return out

    @torch.inference_mode()
    def score_continuations(
        self, pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], namespace: Hashable = None
    ) -> list[torch.Tensor]:
        """``float32`` ``[len(continuation)]`` per ``(context, continuation)``: each token's log-probability.

        Each pair is one row computing ``context[-1:] + continuation[:-1]``
        past the longest cached prefix (at most ``context[:-1]``), its logits
        read at every one of those positions; a long prefix the rows share
        and the tree lacks is computed once first. The keys/values of every
        row enter the tree, as for next-token requests. A pass reads at most
        :attr:`max_score_reads` positions (the logits it holds at once): longer
        work goes in several passes, a long continuation in pieces, each
        continuing the keys/values the previous one left.
        """
        pieces: list[list[torch.Tensor]] = [[] for _ in pairs]
        work = [
            (
                start,
                i,
                context + continuation[:start],
                continuation[start : start + self.max_score_reads],
            )
            for i, (context, continuation) in enumerate(pairs)
            for start in range(0, len(continuation), self.max_score_reads)
        ]
        work.sort(key=lambda piece: piece[0])  # a continuation's pieces in order
        chunk: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        num_reads = 0
        for _, i, context, continuation in work:
            if chunk and num_reads + len(continuation) > self.max_score_reads:
                self._score_chunk(chunk, pieces, namespace)
                chunk, num_reads = [], 0
            chunk.append((i, context, continuation))
            num_reads += len(continuation)
        self._score_chunk(chunk, pieces, namespace)
        return [torch.cat(found) for found in pieces]

    @property
    def max_score_reads(self) -> int:
        """Most positions one scoring pass reads: its ``[N, V]`` float32 logits within 256 MiB."""
        return max(1, (256 << 20) // (4 * self.vocab_size))

    def _score_chunk(
        self,
        chunk: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]],
        pieces: list[list[torch.Tensor]],
        namespace: Hashable,
    ) -> None:
        """Score ``(pair index, context, continuation)`` in one batch; append each piece's scores."""
        fulls = [context + continuation for _, context, continuation in chunk]
        if self.level_policy.enabled:
            for prefixes in self._prefill_rounds(self._lookup(fulls, namespace), namespace):
                self._execute(self._plan(self._lookup(prefixes, namespace)), namespace)
        hosts, offsets = [], [0]
        for k, (_, context, continuation) in enumerate(chunk):
            entry, shared = self.kv_tree.longest_prefix(fulls[k], namespace)
            reused = min(shared, len(context) - 1)
            lookup = Lookup(k, fulls[k], entry if reused > 0 else None, reused)
            first = len(context) - 1 - reused  # the new-token position predicting continuation[0]
            reads = tuple((offsets[-1] + j, first + j) for j in range(len(continuation)))
            hosts.append((lookup, reads))
            offsets.append(offsets[-1] + len(continuation))
        plan = planner.plan_hosts(hosts, offsets[-1], self.level_policy)
        rows = self._execute(plan, namespace)  # [sum of lengths, vocab_size]
        targets = [token for _, _, continuation in chunk for token in continuation]
        scores = rows.gather(1, torch.tensor(targets, device=rows.device)[:, None])[:, 0].cpu()
        for (i, _, _), (a, b) in zip(chunk, itertools.pairwise(offsets)):
            pieces[i].append(scores[a:b])

    @torch.inference_mode()
    def run_uncached(self, request: Request) -> torch.Tensor:
        """Reference: one plain forward pass over the whole context under its adapter, no cache involved."""
        input_ids = torch.tensor([list(request.context)], device=self.device)
        with self.adapters.active(request.adapter):
            logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        return fit_to_vocab(logits, self.vocab_size)[0]

    def load_adapter(self, adapter: Adapter) -> None:
        self.graphs.clear()  # captured under the model as it was
        self.adapters.load(adapter)
        if self._padded_matmuls is not None:
            self._padded_matmuls.attach(self.model)  # the adapter's projections

    def unload_adapter(self, adapter: Adapter) -> None:
        self.graphs.clear()
        self.kv_tree.drop_namespace(adapter)
        self.adapters.unload(adapter)

    def clear(self) -> None:
        self.graphs.clear()
        self.kv_tree.clear()

    def close(self) -> None:
        self.graphs.clear()
        self.kv_tree.clear()

    @torch.inference_mode()
    def logprobs(
        self, contexts: Sequence[tuple[int, ...]], namespace: Hashable = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token after each context, keys/values kept under ``namespace``.

        Runs the model as it is (activating an adapter is :meth:`run`'s job).
        Several contexts sharing a long prefix not cached yet get it computed
        once first, as a batch of its own; then the batch is planned once
        (:func:`~genlm_backend.cache.plan.plan_batch`) and executed.

        Returns:
            ``float32`` ``[len(contexts), vocab_size]`` on the model's device, normalized per row.
        """
        lookups = self._lookup(contexts, namespace)
        if self.level_policy.enabled:
            rounds = self._prefill_rounds(lookups, namespace)
            for prefixes in rounds:
                self._execute(self._plan(self._lookup(prefixes, namespace)), namespace)
            if rounds:  # the tree changed: look again
                lookups = self._lookup(contexts, namespace)
        return self._execute(self._plan(lookups), namespace)

    def _lookup(self, contexts: Sequence[tuple[int, ...]], namespace: Hashable) -> list[Lookup]:
        found = []
        for i, context in enumerate(contexts):
            entry, shared = self.kv_tree.longest_prefix(context, namespace)
            reused = min(shared, len(context) - 1)  # the last token must run to give logits
            found.append(Lookup(i, context, entry if reused > 0 else None, reused))
        return found

    def _plan(self, lookups: list[Lookup]) -> BatchPlan:
        return plan_batch(lookups, self.level_policy)

    def _prefill_rounds(self, lookups: list[Lookup], namespace: Hashable) -> list:
        """Prefixes shared by several contexts with many uncached tokens, to compute first."""
        min_tokens = self.level_policy.min_prefill_tokens
        # Contexts read from a longer one's pass share its computation already.
        hosts = [lookup for lookup, _ in planner.nest(lookups)]
        return planner.shared_uncached_prefixes(
            [lookup.context for lookup in hosts if lookup.num_new > min_tokens],
            lambda prefix: self.kv_tree.cached_length(prefix, namespace),
            min_tokens,
        )

    def _execute(self, plan: BatchPlan, namespace: Hashable) -> torch.Tensor:
        """Run the plan's passes, one-token ones as captured steps where they can be; their keys/values enter the tree once every pass succeeded."""
        out = None
        computed = []
        for pass_plan in plan.passes:
            logprobs, block, placements = self._run_pass(pass_plan, namespace)
            indices = [index for index, _, _ in pass_plan.reads]
            if len(indices) == plan.num_outputs and indices == sorted(indices):
                out = logprobs  # every row, in order
            else:
                if out is None:
                    out = logprobs.new_empty(plan.num_outputs, self.vocab_size)
                out[indices] = logprobs
            computed.append((placements, block))
        # A failed pass leaves nothing in the tree.
        for placements, block in computed:
            self.kv_tree.commit(block, placements, namespace)
        assert out is not None, "a batch has at least one row"
        return out

    def _run_pass(
        self, plan: PassPlan, namespace: Hashable
    ) -> tuple[torch.Tensor, KVBlock, list[Placement]]:
        """A pass's log-probabilities, the block written, and where its rows' contexts are in it."""
        step = (
            self.graphs.plan(plan, namespace)
            if self.graphs.can_capture and plan.num_new == 1
            else None
        )
        ran = self.graphs.run(step) if step is not None else None
        if step is None or ran is None:
            logprobs, block = self._forward(plan)
            return logprobs, block, plan.placements()
        self.num_tokens_computed += len(plan.rows)
        return *ran, step.placements()

    def _forward(self, plan: PassPlan) -> tuple[torch.Tensor, KVBlock]:
        """``[len(plan.reads), vocab_size]`` log-probabilities in the order of ``plan.reads``, and the block written."""
        block = plan.extends if plan.extends is not None else self._block_with_pasts(plan)
        cache = self._cache_over(block, plan.num_past)
        input_ids = torch.tensor(planner.new_tokens(plan)).to(self.device)  # [B, num_new]
        positions = planner.new_positions(plan, self._max_positions)
        position_ids = torch.tensor(positions).to(self.device)
        mask = own_part_mask(plan, block.num_slots, self.model.dtype, self.device)
        levels = cascade_levels(plan, self.device)
        # Nothing cached, no padding: the mask is plain causal, which the fused
        # kernels apply without reading it, skipping the hidden half (a prompt's prefill).
        is_causal = (
            not levels
            and plan.num_past == 0
            and block.num_slots == plan.num_new
            and all(row.num_new == plan.num_new for row in plan.rows)
        )
        attention: dict[str, object]
        if self.deterministic:
            num_groups = self.model.config.get_text_config(decoder=True).num_attention_heads
            num_groups //= kv_shape(self.model.config)[0]
            attention = {"genlm_exact": ExactLayout.of(plan, levels, num_groups, self.device)}
        elif levels:
            attention = {"genlm_cascade": Cascade(levels)}
        else:
            attention = {"genlm_causal": True} if is_causal else {}
        # A one-token step reads each row's only position; a longer pass, the positions of its reads.
        reads = self._read_positions(plan) if plan.num_new > 1 else None
        with (
            grouped_kv_attention(self.model),
            head_sees_only(self.model, reads),
            self._exact_products(),
        ):
            output = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=plan.num_new,
                **attention,
            )
        # logits: [N, 1, V_model] per read, [B, 1, V_model] for one-token steps,
        # or [B, num_new, V_model] for a head the hook cannot reach
        if output.logits.shape[1] == 1 or reads is None:
            logits = output.logits[:, 0]
        else:
            logits = output.logits[reads]
        self.num_tokens_computed += sum(row.num_new for row in plan.rows)
        return fit_to_vocab(logits, self.vocab_size), block

    @contextlib.contextmanager
    def _exact_products(self):
        """While active, with ``deterministic``, projections compute at least 16 rows."""
        padded = self._padded_matmuls
        if padded is None:
            yield
            return
        padded.active = True
        try:
            with self._exact_reductions():
                yield
        finally:
            padded.active = False

    def _exact_reductions(self) -> contextlib.AbstractContextManager:
        """While active, a norm's mean over a row is computed in one order whatever the other rows
        (:class:`~genlm_backend.llm.hf.exact_fused.RowMeans`, where the fused kernels run; on the
        CPU a row's sum does not depend on the others)."""
        if not uses_fused_kernels(self.device):
            return contextlib.nullcontext()
        from genlm_backend.llm.hf.exact_fused import RowMeans

        return RowMeans()

    def _read_positions(self, plan: PassPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, positions)`` of ``plan.reads`` as index tensors on the model's device."""
        reads = plan.reads
        rows = torch.tensor([row for _, row, _ in reads], device=self.device)
        positions = torch.tensor([at for _, _, at in reads], device=self.device)
        return rows, positions

    def _block_with_pasts(self, plan: PassPlan) -> KVBlock:
        """A block of ``num_past + num_new`` slots (and spare ones) with each row's own past right-aligned at ``num_past``."""
        num_past, num_new = plan.num_past, plan.num_new
        # One-token steps get spare slots, so the next steps can write in place (see kv_block.extendable_block).
        num_spare = _num_spare_slots(num_past) if num_new == 1 else 0
        # Slots are not positions (position ids are given): rows whose own pasts and new tokens
        # together pass the model's longest sequence still get every slot they need.
        num_slots = max(
            min(num_past + num_new + num_spare, self._max_positions), num_past + num_new
        )
        num_layers = self._static_cache.num_layers
        num_kv_heads, head_dim = kv_shape(self.model.config)
        shape = (len(plan.rows), num_kv_heads, num_slots, head_dim)
        self.kv_tree.reserve(
            cache_nbytes(
                num_layers, len(plan.rows), num_kv_heads, num_slots, head_dim, self.model.dtype
            ),
            pinned=[entry for row in plan.rows for entry, _ in row.levels + row.own],
        )
        block = KVBlock.empty(num_layers, shape, self.model.dtype, self.device)
        block.copy_in(planner.own_part_copies(plan))
        # Every slot is written above or by the forward pass itself; only the left
        # padding is zeroed (masked, but it must not hold NaN bit patterns), and the
        # spare slots (masked, but read by attention). One operation each for all layers.
        slots = block.stacked  # [L, 2, B, H, T, D]
        for i, row in enumerate(plan.rows):
            if row.num_own_past < num_past:
                slots[:, :, i, :, : num_past - row.num_own_past].zero_()
        if num_past + num_new < num_slots:
            slots[..., num_past + num_new :, :].zero_()
        return block

    def _cache_over(self, block: KVBlock, num_past: int):
        """A StaticCache whose layers are ``block``'s tensors, the next token going to slot ``num_past``."""
        return self._static_cache(block.layers, num_past)


def _num_spare_slots(num_past: int) -> int:
    """Room left in a one-token step's block for later steps: 1/4 of its length, at least 8."""
    return max(8, num_past // 4)


def own_part_mask(plan: PassPlan, num_slots: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask ``[B, 1, num_new, num_slots]``: each row sees its own past and its causal new tokens."""
    slots = torch.arange(num_slots)
    queries = torch.arange(plan.num_new)[:, None] + plan.num_past  # slot of each query
    first = torch.tensor(planner.row_starts(plan))[:, None, None]
    visible = (slots[None, None, :] >= first) & (slots[None, None, :] <= queries[None])
    mask = torch.zeros(len(plan.rows), 1, plan.num_new, num_slots, dtype=dtype)
    mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
    return mask.to(device)


def cascade_levels(plan: PassPlan, device: torch.device) -> list[Level]:
    """The pass's distinct levels, each with the rows that read it (``None``: every row)."""
    return [
        Level(
            entry.block,
            entry.row,
            entry.start,
            n,
            None if len(rows) == len(plan.rows) else torch.tensor(rows, device=device),
        )
        for (entry, n), rows in planner.level_readers(plan.rows)
    ]
