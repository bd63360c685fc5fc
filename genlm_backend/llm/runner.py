"""The seam between :class:`~genlm_backend.llm.base.AsyncLM` and a model: requests in, rows out.

A runner turns a batch of distinct :class:`Request`\\ s into one ``[B, V]``
tensor, synchronously and without asyncio. Each request carries its own
adapter and context, so nothing about a request is read from state that may
change between the call and the batch (e.g. a "current adapter").
Everything else (validation, output cache, batching, sync bridge, sampling)
lives once in ``AsyncLM``.

Every backend that keeps a KV prefix tree (transformers, MLX) runs the one
:class:`PrefixCacheRunner` here: requests grouped by adapter, each group
handed to the :class:`PrefixCacheDriver`, which looks each context up in the
:class:`~genlm_backend.cache.kv_tree.KVPrefixTree`, computes first the
prefixes several contexts share and the tree lacks (its *prefill rounds*),
plans the batch once (:func:`~genlm_backend.cache.plan.plan_batch`), has the
backend's :class:`PassExecutor` run each planned pass, and commits the
passes' keys/values to the tree once every pass succeeded. Scoring a
continuation is the same, each row read at several positions. A backend
contributes its executor (the transformers model, MLX) and how it activates
an adapter; the driver is the same for all of them.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from genlm_backend.cache import plan as planner
from genlm_backend.cache.kv_block import KVBlock, KVEntry, Placement
from genlm_backend.cache.kv_tree import KVPrefixTree, context_hash, tail_hash
from genlm_backend.cache.plan import BatchPlan, LevelPolicy, Lookup, PassPlan


@dataclass(frozen=True)
class Adapter:
    """One registration of a LoRA adapter: a name bound to weights.

    Registering a name again makes a new ``Adapter`` (a new ``version``), so
    results and keys/values cached under the old weights never match a request
    made under the new ones. ``version`` is unique across all names of one
    backend (vLLM uses it as the adapter's integer id).
    """

    name: str
    version: int
    path: str


class Request:
    """One next-token request: a context, run under ``adapter`` (``None``: the base model).

    Not to be changed once made (plain slots, with no guard: a particle's
    call makes one at every step, and a guarded one took twice as long).
    Hashed once, from the adapter and the whole context
    (:func:`~genlm_backend.cache.kv_tree.context_hash`, which the front
    computes from the context's parent's in a slice's time): a request is a
    key of the batcher and the output cache at every step, and Python's hash
    of a long context reads all of it. A request made without its hash
    reads its context once, at its first hashing.

    ``parent``, when known, is the context one token shorter as an earlier
    request held it (the same tuple): the KV tree finds its node by it
    without reading the context. Not part of the request's identity.
    """

    __slots__ = ("_hash", "adapter", "context", "parent")

    adapter: Adapter | None
    context: tuple[int, ...]
    parent: tuple[int, ...] | None
    _hash: int | None
    continuation: tuple[()] = ()
    """Empty: a request reads its context alone (a :class:`ScoreRequest` reads its context
    and its continuation), so the two count their tokens alike."""

    def __init__(
        self,
        adapter: Adapter | None,
        context: tuple[int, ...],
        parent: tuple[int, ...] | None = None,
        *,
        hashed: int | None = None,
    ):
        """``hashed``: ``context_hash(context)``, when the caller has it already."""
        self.adapter = adapter
        self.context = context
        self.parent = parent
        if hashed is not None and adapter is not None:
            hashed = hash((adapter, hashed))
        self._hash = hashed  # under the base model, the context_hash itself

    def __hash__(self) -> int:
        hashed = self._hash
        if hashed is None:
            hashed = context_hash(self.context)
            if self.adapter is not None:
                hashed = hash((self.adapter, hashed))
            self._hash = hashed
        return hashed

    def __eq__(self, other: object) -> bool:
        if type(other) is not Request:
            return NotImplemented
        return self.adapter == other.adapter and (
            self.context is other.context or self.context == other.context
        )

    def __repr__(self) -> str:
        return f"Request(adapter={self.adapter!r}, context={self.context!r})"

    def __reduce__(self):
        # Rebuilt, not copied: the hash of an adapter's name differs between processes.
        return type(self), (self.adapter, self.context)


@dataclass(frozen=True)
class ScoreRequest:
    """A scoring request: the log-probability of each token of ``continuation`` after ``context``.

    Token ``i``'s log-probability is that of ``continuation[i]`` after
    ``context + continuation[:i]``, under ``adapter`` (``None``: the base model).
    """

    adapter: Adapter | None
    context: tuple[int, ...]
    continuation: tuple[int, ...]
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(
            self,
            "_hash",
            hash((self.adapter, tail_hash(self.context), tail_hash(self.continuation))),
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return type(self), (self.adapter, self.context, self.continuation)

    def prefixes(self) -> list[Request]:
        """The next-token requests whose rows hold this request's scores, in order."""
        full = self.context + self.continuation
        return [Request(self.adapter, full[:end]) for end in range(len(self.context), len(full))]


@dataclass(frozen=True)
class RunnerStats:
    """What a runner reports to :class:`~genlm_backend.llm.base.LMStats`."""

    num_tokens_computed: int
    """Tokens the model ran (see ``LMStats.num_tokens_computed``)."""
    kv_cache_bytes: int
    """Bytes of keys/values held for prefix reuse (0 without such a cache)."""


class Runner(Protocol):
    """What ``AsyncLM`` needs from a model. Called with ``AsyncLM``'s compute lock held, never concurrently."""

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        """Next-token log-probabilities of each (distinct) request.

        Returns:
            ``float32`` ``[len(requests), vocab_size]``, normalized per row, on the backend's
            device: a fresh tensor (no other holder; its rows go to the callers as views),
            not an inference tensor (callers may write to their rows).

        Raises:
            ValueError: a request's adapter is not (or no longer) loaded.
        """

    def request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget: at least 1, at most
        ``len(request.context)`` (the engine skips the lookups when the contexts' lengths
        fit the budget).

        Called from the event loop while a batch may run: an estimate is fine.
        """

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Each (distinct) request's continuation scored: ``float32`` ``[len(continuation)]`` each.

        Raises:
            ValueError: a request's adapter is not (or no longer) loaded.
        """

    def run_uncached(self, request: Request) -> torch.Tensor:
        """The reference: one plain forward over the whole context, no cache read or written. ``[vocab_size]``."""

    @property
    def stats(self) -> RunnerStats: ...

    def load_adapter(self, adapter: Adapter) -> None:
        """Load ``adapter``'s weights (replacing an adapter of the same name).

        Raises:
            ValueError: this runner cannot serve adapters (the message says why).
        """

    def unload_adapter(self, adapter: Adapter) -> None:
        """Unload ``adapter`` and drop every cache entry computed under it."""

    def clear(self) -> None:
        """Drop every cached key/value (model-side caches); results stay valid."""

    def close(self) -> None:
        """Release the model; later calls are not made."""


def fit_to_vocab(logits: torch.Tensor, vocab_size: int, own: bool = False) -> torch.Tensor:
    """``[B, V_model]`` logits -> ``[B, vocab_size]`` float32 log-probabilities.

    Columns past the tokenizer's vocabulary are dropped (the rest renormalized);
    missing columns are ``-inf``. The result is a plain tensor even in inference mode: callers
    are handed its rows, and may write to them.

    ``own``: the logits are the caller's to overwrite (a model's fresh output,
    which nothing else holds). Float32 logits of exactly ``vocab_size`` columns on
    the CPU are then normalized where they lie, as the same bits: no second
    ``[B, V]`` buffer (new memory at each step while the output cache holds the
    last steps' rows), and the logits are read back while the head's product
    still has them in cache (``benchmarks/bench_head.py``). Inference
    tensors are first viewed as plain ones (``torch.from_dlpack``), so callers
    may still write to their rows.
    """
    with torch.inference_mode(False):
        if (
            own
            and logits.dtype == torch.float32
            and logits.shape[-1] == vocab_size
            and logits.device.type == "cpu"
            and not logits.requires_grad
        ):
            plain = torch.from_dlpack(logits) if logits.is_inference() else logits
            return torch.log_softmax(plain, dim=-1, out=plain)
        logits = logits.float()
        num_columns = logits.shape[-1]
        if num_columns > vocab_size:
            logits = logits[:, :vocab_size]
        elif num_columns < vocab_size:
            logits = torch.nn.functional.pad(
                logits, (0, vocab_size - num_columns), value=float("-inf")
            )
        return torch.log_softmax(logits, dim=-1)


def group_by_adapter(
    requests: Sequence[Request | ScoreRequest],
) -> dict[Adapter | None, list[int]]:
    """Positions of the requests of each adapter, adapters in order of first appearance."""
    first = requests[0].adapter if requests else None
    if all(request.adapter is first for request in requests):  # the usual batch: one adapter
        return {first: list(range(len(requests)))}
    groups: dict[Adapter | None, list[int]] = {}
    for position, request in enumerate(requests):
        groups.setdefault(request.adapter, []).append(position)
    return groups


def score_from_rows(
    run: Callable[[Sequence[Request]], torch.Tensor], requests: Sequence[ScoreRequest]
) -> list[torch.Tensor]:
    """Scores gathered from next-token rows, one row per prefix: for runners without a scoring path of their own.

    ``run`` is the runner's :meth:`Runner.run`; prefixes shared by several
    requests are computed once.
    """
    prefixes = [request.prefixes() for request in requests]
    distinct = list(dict.fromkeys(request for group in prefixes for request in group))
    position = {request: i for i, request in enumerate(distinct)}
    rows = run(distinct)  # [P, V]
    return [
        rows[
            torch.tensor([position[prefix] for prefix in group]),
            torch.tensor(request.continuation),
        ]
        for request, group in zip(requests, prefixes)
    ]


# ---------------------------------------------------------------------- the prefix-cache runner


@dataclass(frozen=True)
class ExecutorSupport:
    """What an executor can run besides plain passes."""

    adapters: bool
    """Passes under a LoRA adapter."""
    captured_steps: bool
    """One-token passes replayed as captured graphs, where the device captures."""
    exact_rows: bool
    """Rows with the bits of their context computed alone (``deterministic=True``)."""


@dataclass
class PassResult:
    """What one executed pass gives: its rows and the keys/values it wrote."""

    logprobs: torch.Tensor
    """``float32 [len(plan.reads), V]``, normalized, in the order of ``plan.reads``."""
    block: KVBlock
    """The block holding the pass's keys/values."""
    placements_of: Callable[[], list[Placement]]
    """Makes :attr:`placements` (a step planned from the last one is committed without them)."""

    @functools.cached_property
    def placements(self) -> list[Placement]:
        """Where the tree finds each row's context in ``block``."""
        return self.placements_of()


class PassExecutor(Protocol):
    """Runs one planned pass of a model: the seam between the driver and a backend's model."""

    support: ExecutorSupport
    level_policy: LevelPolicy
    """How this executor's passes read cached pieces (read once for many rows, or copied)."""

    def run_pass(self, plan: PassPlan, namespace: Hashable) -> PassResult:
        """Run ``plan`` with the model as it is (under ``namespace``'s adapter, active already).

        Raises:
            Exception: the model's error; nothing enters the tree.
        """


class PrefixCacheDriver:
    """Next-token rows and continuation scores of contexts, every cached prefix reused.

    Not thread-safe: one batch at a time (the engine's lock).

    Args:
        kv_tree: Where keys/values are looked up and left.
        executor: Runs each planned pass.
        vocab_size: Columns of the rows.
        max_score_reads: Most positions one scoring pass reads (its logits held
            at once); ``None``: 256 MiB of float32 logits.
    """

    def __init__(
        self,
        kv_tree: KVPrefixTree,
        executor: PassExecutor,
        vocab_size: int,
        max_score_reads: int | None = None,
    ):
        self.kv_tree = kv_tree
        self.executor = executor
        self.vocab_size = vocab_size
        self.max_score_reads = max_score_reads or max(1, (256 << 20) // (4 * vocab_size))
        self.num_tokens_computed = 0
        self._in_place: InPlaceStep | None = None

    @property
    def level_policy(self) -> LevelPolicy:
        return self.executor.level_policy

    def request_tokens(
        self, context: tuple[int, ...], namespace: Hashable, parent: tuple[int, ...] | None
    ) -> int:
        """A context's cost against a batch's token budget: the tokens it adds to the batch's
        working memory (an estimate: another thread may change the tree meanwhile).

        With levels, the part not cached yet (a particle behind a cached
        prompt costs its own tokens); without them, every token (each row
        holds its whole past).
        """
        if not self.level_policy.enabled:
            return len(context)
        return max(1, len(context) - self.kv_tree.cached_length(context, namespace, parent))

    def logprobs(
        self,
        contexts: Sequence[tuple[int, ...]],
        namespace: Hashable = None,
        parents: Sequence[tuple[int, ...] | None] | None = None,
    ) -> torch.Tensor:
        """``float32 [len(contexts), V]``: the next-token log-probabilities after each context,
        keys/values kept under ``namespace``.

        Several contexts sharing a long prefix not cached yet get it computed
        once first, as a batch of its own; then the batch is planned once and executed.
        ``parents``: each context's :attr:`Request.parent <genlm_backend.llm.runner.Request.parent>`
        (the tree finds its node by the tuple's identity, without reading the context).
        """
        last, self._in_place = self._in_place, None
        policy = self.level_policy
        followed = None
        kept: list[KVEntry | None] | None
        if last is not None and parents is not None:
            followed = last.next_plan(contexts, parents, namespace, policy, self.kv_tree)
        if followed is not None:
            plan, entries, grown = followed  # in the block's order
            in_order = grown is contexts
            out, kept = self._execute_in_place(plan, entries, grown, namespace, in_order)
            contexts = grown
        else:
            lookups = self.lookup(contexts, namespace, parents)
            if policy.enabled and self.prefill_shared(lookups, namespace):
                lookups = self.lookup(contexts, namespace)  # the tree changed: look again
            plan = planner.plan_batch(lookups, policy)
            kept = [] if InPlaceStep.may_follow(plan, policy) else None
            out = self.execute(plan, namespace, kept)
            if kept is not None:  # the contexts in the block's order, as their entries
                contexts = [row.context for row in plan.passes[0].rows]
        if kept is not None and None not in kept:
            end = plan.passes[0].num_past + 1
            entries = cast(list[KVEntry], kept)  # none is None
            self._in_place = InPlaceStep(contexts, end, entries, namespace, policy)
        return out

    def advance(
        self,
        contexts: Sequence[tuple[int, ...]],
        namespace: Hashable,
        max_tokens: int,
        parents: Sequence[tuple[int, ...] | None] | None = None,
    ) -> int:
        """Compute a chunk of at most ``max_tokens`` tokens of the long prefills among
        ``contexts``: the tokens computed (0 when nothing needed chunking, and nothing
        was computed).

        Nothing is chunked when the contexts need ``max_tokens`` tokens or
        fewer in all. Else a chunk is the next tokens of the prefixes several
        contexts share and the tree lacks (``min_prefill_tokens`` or more, as
        :meth:`prefill_shared` computes them), or else of each context longer
        than ``max_tokens`` up to its last token, in order; it enters the
        tree, so the next chunk, and the rows, continue from it. Short
        contexts are left to the rows' pass: many rows of a few tokens
        (particles' steps) are one cheap pass, not a long one. A shared
        prefix's chunk takes its whole rest when less than
        ``min_prefill_tokens`` would be left (a chunk then exceeds ``max_tokens``
        by less than that): a shorter rest would be computed by every row. With
        ``block_tokens`` levels (exact rows), a chunk that reaches past a block
        boundary ends at one. When the tree cannot keep a chunk whole (a
        budget below the prefill's keys/values), returns 0 as well: the rows'
        pass computes the rest, so chunking always ends. ``parents``: as for :meth:`logprobs`.
        """
        if sum(map(len, contexts)) <= max_tokens:
            return 0  # the whole step is no longer than a chunk, whatever the tree holds
        last = self._in_place
        if (
            len(contexts) <= max_tokens
            and parents is not None
            and last is not None
            and last.continues(contexts, parents, namespace)
            and last.is_cached(self.kv_tree)
        ):
            return 0  # the last step's particles, whose parents the tree holds: a token each
        # Particles' steps behind a long prompt: each costs its last token (a lookup by its
        # parent's identity, no entry marked used); the step fits without planning it.
        given = parents if parents is not None else itertools.repeat(None)
        costs = (self.request_tokens(c, namespace, p) for c, p in zip(contexts, given))
        if sum(costs) <= max_tokens:
            return 0
        lookups = self.lookup(contexts, namespace, parents)
        hosts = [lookup for lookup, _ in planner.nest(lookups)]
        # A context several requests share (a scoring call's) counts once.
        if sum({id(lookup.context): lookup.num_new for lookup in hosts}.values()) <= max_tokens:
            return 0  # the whole step is no longer than a chunk
        cached = lambda prefix: self.kv_tree.cached_length(prefix, namespace)  # noqa: E731
        work: list[tuple[tuple[int, ...], int]] = []  # (prefix, its tokens to compute)
        min_shared = 0  # the shortest rest of a shared prefix left to a later chunk
        if self.level_policy.enabled:
            # A shared prefix goes alone, in chunks, even when its rest fits in one: computed
            # with the rows, it would make their step a chunk and the rows' pass together.
            min_shared = self.level_policy.min_prefill_tokens
            sharing = [lookup.context for lookup in hosts if lookup.num_new > min_shared]
            rounds = planner.shared_uncached_prefixes(sharing, cached, min_shared)
            work = [(prefix, len(prefix)) for prefix in rounds[0]] if rounds else []
        if not work:
            long = [lookup.context for lookup in hosts if lookup.num_new > max_tokens]
            work, min_shared = [(context, len(context) - 1) for context in long], 0
        block = self.level_policy.block_tokens
        chunks, budget = [], max_tokens
        for prefix, end in work:
            start = cached(prefix[:end])
            take = min(end - start, budget)
            if take <= 0:
                continue
            if 0 < end - start - take < min_shared:
                # A shorter rest would no longer count as shared: every row would compute it.
                take = end - start
            if block and take < end - start and (start + take) // block > start // block:
                take -= (start + take) % block  # end the chunk at a block boundary
            chunks.append(prefix[: start + take])
            budget -= take
            if budget <= 0:
                break
        if not chunks:
            return 0
        self.logprobs(chunks, namespace)  # their rows are dropped: the tree keeps the chunk
        if any(cached(chunk) < len(chunk) for chunk in chunks):
            return 0  # the tree could not keep a chunk: no progress, the rows' pass computes all
        return max_tokens - budget

    def lookup(
        self,
        contexts: Sequence[tuple[int, ...]],
        namespace: Hashable,
        parents: Sequence[tuple[int, ...] | None] | None = None,
    ) -> list[Lookup]:
        """What the tree holds of each context (its last token always runs: it gives the logits)."""
        found = []
        longest_prefix = self.kv_tree.longest_prefix
        for i, context in enumerate(contexts):
            parent = None if parents is None else parents[i]
            entry, shared = longest_prefix(context, namespace, parent)
            reused = min(shared, len(context) - 1)
            found.append(Lookup(i, context, entry if reused > 0 else None, reused))
        return found

    def prefill_shared(self, lookups: list[Lookup], namespace: Hashable) -> bool:
        """Compute the prefixes that several contexts share with many uncached tokens, as
        batches of their own; whether there were any."""
        min_tokens = self.level_policy.min_prefill_tokens
        if all(lookup.num_new <= min_tokens for lookup in lookups):
            return False  # particles' steps: no context has that many tokens to compute
        # Contexts read from a longer one's pass share its computation already.
        hosts = [lookup for lookup, _ in planner.nest(lookups)]
        rounds = planner.shared_uncached_prefixes(
            [lookup.context for lookup in hosts if lookup.num_new > min_tokens],
            lambda prefix: self.kv_tree.cached_length(prefix, namespace),
            min_tokens,
        )
        for prefixes in rounds:
            lookups = self.lookup(prefixes, namespace)
            self.execute(planner.plan_batch(lookups, self.level_policy), namespace)
        return bool(rounds)

    def execute(
        self, plan: BatchPlan, namespace: Hashable, kept: list | None = None
    ) -> torch.Tensor:
        """Run the plan's passes: ``float32 [plan.num_outputs, V]``; their keys/values enter the
        tree once every pass succeeded (a failed pass leaves nothing in it). ``kept``: gets
        each committed row's entry (see :meth:`KVPrefixTree.commit`)."""
        out: torch.Tensor | None = None
        results = []
        for pass_plan in plan.passes:
            result = self.executor.run_pass(pass_plan, namespace)
            self.num_tokens_computed += sum(row.num_new for row in pass_plan.rows)
            out = _placed_outputs(out, pass_plan, result.logprobs, plan.num_outputs)
            results.append(result)
        for result in results:
            self.kv_tree.commit(result.block, result.placements, namespace, kept)
        assert out is not None, "a batch has at least one row"
        return out

    def _execute_in_place(
        self,
        plan: BatchPlan,
        entries: list[KVEntry],
        contexts: Sequence[tuple[int, ...]],
        namespace: Hashable,
        in_order: bool,
    ) -> tuple[torch.Tensor, list[KVEntry | None]]:
        """Run a step planned from the last one (:meth:`InPlaceStep.next_plan`): its rows, in
        the batch's order (``in_order``: the batch is in the block's, which the pass runs),
        and each row's entry once committed, in the block's order (as ``entries`` and
        ``contexts``). Committed by growing ``entries`` a slot
        (:meth:`~genlm_backend.cache.kv_tree.KVPrefixTree.grow_in_place`, which
        :meth:`~genlm_backend.cache.kv_tree.KVPrefixTree.extend_in_place` checked before the
        pass), without its placements, unless the executor wrote another block (a captured
        step's): then as any pass."""
        (pass_plan,) = plan.passes
        result = self.executor.run_pass(pass_plan, namespace)
        self.num_tokens_computed += len(pass_plan.rows)
        out = result.logprobs
        if not in_order:
            out = _placed_outputs(None, pass_plan, out, plan.num_outputs)
        if result.block is not pass_plan.extends:
            kept: list[KVEntry | None] = []
            self.kv_tree.commit(result.block, result.placements, namespace, kept)
            return out, kept
        return out, self.kv_tree.grow_in_place(entries, contexts, namespace)

    def score(
        self, pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], namespace: Hashable = None
    ) -> list[torch.Tensor]:
        """``float32 [len(continuation)]`` per ``(context, continuation)``: each token's log-probability.

        Each pair is one row computing ``context[-1:] + continuation[:-1]``
        past the longest cached prefix (at most ``context[:-1]``), its logits
        read at every one of those positions; a long prefix the rows share
        and the tree lacks is computed once first. The keys/values of every
        row enter the tree, as for next-token requests. A pass reads at most
        :attr:`max_score_reads` positions: longer work goes in several passes,
        a long continuation in pieces, each continuing the keys/values the
        previous one left.
        """
        pieces: list[list[torch.Tensor]] = [[] for _ in pairs]
        step = self.max_score_reads
        work = [
            (start, i, context + continuation[:start], continuation[start : start + step])
            for i, (context, continuation) in enumerate(pairs)
            for start in range(0, len(continuation), step)
        ]
        work.sort(key=lambda piece: piece[0])  # a continuation's pieces in order
        chunk: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        num_reads = 0
        for _, i, context, continuation in work:
            if chunk and num_reads + len(continuation) > step:
                self._score_chunk(chunk, pieces, namespace)
                chunk, num_reads = [], 0
            chunk.append((i, context, continuation))
            num_reads += len(continuation)
        self._score_chunk(chunk, pieces, namespace)
        return [torch.cat(found) for found in pieces]

    def _score_chunk(
        self,
        chunk: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]],
        pieces: list[list[torch.Tensor]],
        namespace: Hashable,
    ) -> None:
        """Score ``(pair index, context, continuation)`` in one batch; append each piece's scores."""
        fulls = [context + continuation for _, context, continuation in chunk]
        if self.level_policy.enabled:
            self.prefill_shared(self.lookup(fulls, namespace), namespace)
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
        rows = self.execute(plan, namespace)  # [sum of lengths, V]
        targets = [token for _, _, continuation in chunk for token in continuation]
        scores = rows.gather(1, torch.tensor(targets, device=rows.device)[:, None])[:, 0].cpu()
        for (i, _, _), (a, b) in zip(chunk, itertools.pairwise(offsets)):
            pieces[i].append(scores[a:b])


def _placed_outputs(
    out: torch.Tensor | None, pass_plan: PassPlan, logprobs: torch.Tensor, num_outputs: int
) -> torch.Tensor:
    """A batch's rows with a pass's ``logprobs`` (in the order of its reads) placed at their
    outputs: the pass's own tensor when it holds every output in order, else ``out`` (made
    when ``None``) with them written in."""
    indices = [index for index, _, _ in pass_plan.reads]
    if len(indices) == num_outputs and indices == sorted(indices):
        return logprobs  # every row, in order
    if out is None:
        with torch.inference_mode(False):  # a tensor callers may write to
            out = logprobs.new_empty(num_outputs, logprobs.shape[-1])
    out[indices] = logprobs
    return out


class InPlaceStep:
    """A particles' step just committed in place, from which the next one is planned.

    Particles without resampling extend their contexts by one token a step,
    each writing the next slot of its row of one block
    (:func:`~genlm_backend.cache.plan.extendable_block`). When a batch names
    the last step's contexts as its parents, in the same order, and the tree
    still holds those entries as committed
    (:meth:`~genlm_backend.cache.kv_tree.KVPrefixTree.extend_in_place`), its
    plan is the last one a slot further: no lookup, no planning. Equal to
    the plan :func:`~genlm_backend.cache.plan.plan_batch` makes from the
    lookups (a test holds them equal); anything else is looked up and planned.
    The entries are held weakly: an evicted block's memory is not kept here.
    """

    def __init__(
        self,
        contexts: Sequence[tuple[int, ...]],
        end: int,
        entries: Sequence[KVEntry],
        namespace: Hashable,
        policy: LevelPolicy,
    ):
        self.contexts = contexts
        self.end = end
        """The slot each row's entry ends at: the one the next step writes."""
        self._entries = [weakref.ref(entry) for entry in entries]
        self.namespace = namespace
        self.policy = policy

    @staticmethod
    def may_follow(plan: BatchPlan, policy: LevelPolicy) -> bool:
        """Whether ``plan`` is one pass of one token a row whose rows give the batch's rows, one
        each (in any order): a plan the next step can continue (levels at any offset:
        ``block_tokens`` unset). The pass may write in place or into a new block: a new
        block of one-token rows has spare slots, which the next step extends in place
        (:meth:`next_plan` checks the room), rather than being looked up and planned
        again."""
        if len(plan.passes) != 1 or policy.block_tokens is not None:
            return False
        (pass_plan,) = plan.passes
        return (
            pass_plan.num_new == 1
            and plan.num_outputs == len(pass_plan.rows)
            and all(len(row.reads) == 1 for row in pass_plan.rows)
        )

    def continues(
        self,
        contexts: Sequence[tuple[int, ...]],
        parents: Sequence[tuple[int, ...] | None],
        namespace: Hashable,
    ) -> bool:
        """Whether the batch names the last step's contexts as its parents, in any order,
        under its namespace, each context one token longer (what the tree holds is not checked)."""
        return self.order(contexts, parents, namespace) is not None

    def order(
        self,
        contexts: Sequence[tuple[int, ...]],
        parents: Sequence[tuple[int, ...] | None],
        namespace: Hashable,
    ) -> Sequence[int] | None:
        """For each of the last step's rows, the batch's index of the context that extends
        it (a ``range`` when the batch is in the last step's order), or ``None``: the batch
        does not continue the last step (see :meth:`continues`).

        A server's batch gathers its clients' requests in the order they came: the
        same particles, in another order each step.
        """
        last = self.contexts
        if namespace != self.namespace or len(contexts) != len(last):
            return None
        if all(map(operator.is_, parents, last)):
            if all(len(c) == len(p) + 1 for c, p in zip(contexts, last)):
                return range(len(last))
            return None
        row_of = {id(context): i for i, context in enumerate(last)}
        order = [-1] * len(last)
        for j, (context, parent) in enumerate(zip(contexts, parents)):
            i = row_of.get(id(parent), -1)
            if i < 0 or last[i] is not parent or order[i] >= 0 or len(context) != len(parent) + 1:
                return None
            order[i] = j
        return order

    def is_cached(self, kv_tree: KVPrefixTree) -> bool:
        """Whether the tree still holds every entry of the step (each holds its context)."""
        return all(kv_tree.is_cached(ref()) for ref in self._entries)

    def next_plan(
        self,
        contexts: Sequence[tuple[int, ...]],
        parents: Sequence[tuple[int, ...] | None],
        namespace: Hashable,
        policy: LevelPolicy,
        kv_tree: KVPrefixTree,
    ) -> tuple[BatchPlan, list[KVEntry], Sequence[tuple[int, ...]]] | None:
        """The plan of the batch extending each of the last step's contexts by one token, in
        any order, the entries its rows grow and the contexts they grow into (both in the
        last step's order, the block's rows'), or ``None``: it is not that batch, or the tree
        changed under it. Row ``i`` of the plan reads the output of the batch's context
        that extends the last step's ``i``-th."""
        if policy is not self.policy:
            return None
        order = self.order(contexts, parents, namespace)
        if order is None:
            return None
        found = [ref() for ref in self._entries]
        if None in found:
            return None  # evicted, and dropped
        entries = cast(list[KVEntry], found)
        block, end = entries[0].block, self.end
        if not kv_tree.extend_in_place(entries, block, end, namespace):
            return None
        grown = contexts if type(order) is range else [contexts[j] for j in order]
        levels_of: dict = {}
        rows = tuple(
            planner.in_place_row(context, entry, ((j, 0),), levels_of)
            for j, context, entry in zip(order, grown, entries)
        )
        return BatchPlan((PassPlan(rows, end, 1, block),), len(contexts)), entries, grown


class AdapterSlots(Protocol):
    """A backend's loaded adapters."""

    def active(self, adapter: Adapter | None) -> AbstractContextManager:
        """Run the model under ``adapter`` (``None``: the base model) within this block.

        Raises:
            ValueError: ``adapter`` is no longer the registration loaded under its name.
        """

    def load(self, adapter: Adapter) -> None: ...

    def unload(self, adapter: Adapter) -> None: ...


class PrefixCacheRunner:
    """Turns batches of requests into next-token log-probabilities with KV-prefix reuse.

    Args:
        driver: Runs batches of contexts over the KV tree.
        adapters: The backend's adapters.
        device: Where the rows are.
    """

    def __init__(self, driver: PrefixCacheDriver, adapters: AdapterSlots, device: torch.device):
        self.driver = driver
        self.adapters = adapters
        self.output_device = device

    @property
    def kv_tree(self) -> KVPrefixTree:
        return self.driver.kv_tree

    @property
    def level_policy(self) -> LevelPolicy:
        """How the executor's passes read cached pieces (settable: tests and benchmarks try others)."""
        return self.driver.executor.level_policy

    @level_policy.setter
    def level_policy(self, policy: LevelPolicy) -> None:
        self.driver.executor.level_policy = policy

    @property
    def vocab_size(self) -> int:
        return self.driver.vocab_size

    @property
    def num_tokens_computed(self) -> int:
        return self.driver.num_tokens_computed

    @property
    def stats(self) -> RunnerStats:
        return RunnerStats(
            num_tokens_computed=self.driver.num_tokens_computed,
            kv_cache_bytes=self.kv_tree.bytes_held,
        )

    def request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget (see
        :meth:`~genlm_backend.cache.driver.PrefixCacheDriver.request_tokens`)."""
        return self.driver.request_tokens(request.context, request.adapter, request.parent)

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        """``[len(requests), vocab_size]`` float32 log-probabilities on the rows' device."""
        groups = group_by_adapter(requests)
        if len(groups) == 1:  # one adapter: the rows are already in order
            ((adapter, _),) = groups.items()
            with self.adapters.active(adapter):
                contexts = [request.context for request in requests]
                return self.logprobs(contexts, adapter, [request.parent for request in requests])
        out = torch.empty(
            len(requests), self.vocab_size, dtype=torch.float32, device=self.output_device
        )
        for adapter, positions in groups.items():
            with self.adapters.active(adapter):
                contexts = [requests[i].context for i in positions]
                parents = [requests[i].parent for i in positions]
                out[positions] = self.logprobs(contexts, adapter, parents)
        return out

    def logprobs(
        self,
        contexts: Sequence[tuple[int, ...]],
        namespace=None,
        parents: Sequence[tuple[int, ...] | None] | None = None,
    ) -> torch.Tensor:
        """The driver's rows of ``contexts`` with the model as it is (no adapter activated)."""
        return self.driver.logprobs(contexts, namespace, parents)

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Each continuation scored from one forward pass over it, its context's keys/values reused."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(requests)
        for adapter, positions in group_by_adapter(requests).items():
            with self.adapters.active(adapter):
                scores = self.driver.score(
                    [(requests[i].context, requests[i].continuation) for i in positions],
                    adapter,
                )
            for i, found in zip(positions, scores):
                out[i] = found
        return out

    def advance(self, requests: Sequence[Request | ScoreRequest], max_tokens: int) -> int:
        """Compute a chunk of at most ``max_tokens`` tokens of the long prefills ``requests``
        need before their rows (a prompt's): the tokens computed, 0 when none has more than
        ``max_tokens`` tokens to compute (see :meth:`PrefixCacheDriver.advance`). A score
        request's context comes first."""
        budget = max_tokens
        for adapter, positions in group_by_adapter(requests).items():
            contexts = [requests[i].context for i in positions]
            parents = [getattr(requests[i], "parent", None) for i in positions]
            with self.adapters.active(adapter):
                budget -= self.driver.advance(contexts, adapter, budget, parents)
            if budget <= 0:
                break
        return max_tokens - budget

    def load_adapter(self, adapter: Adapter) -> None:
        self.adapters.load(adapter)

    def unload_adapter(self, adapter: Adapter) -> None:
        self.kv_tree.drop_namespace(adapter)
        self.adapters.unload(adapter)

    def clear(self) -> None:
        self.kv_tree.clear()

    def close(self) -> None:
        self.clear()
