"""One-token steps (the SMC step) as captured graphs, replayed with new inputs.

A one-token pass of a batch plan (every row computes one new token) runs as
a captured graph where the device can capture one (CUDA graphs; on CPU only
through the tests' emulation, ``tests/graph_emulation.py``). What a graph
depends on is its :class:`GraphKey`: the adapter, the rows padded to a
bucket, the slots of its own-part storage, and the shared levels it reads
(each read once per step, as in the eager path). Everything that changes
from step to step is device data in the graph's ``inputs``, filled by one
host-to-device copy: the tokens, positions, the slot each row writes, the
first slot each row sees, and which rows read which level.

Each graph owns the storage of its rows' own keys/values, ``[L, 2, R, H, T,
D]``, which is a block of the KV tree: a step whose rows all extend their
own row of it writes in place. A step whose rows come from elsewhere (a
resample, a new prompt, rows padded to another bucket) renews it: the tree's
block moves to a copy if the tree still holds it, and the rows' own parts are
copied into the storage, whose addresses do not change, so no recapture.
Own parts outgrowing the storage go to a graph with more slots.

The captured function computes its attention as the runner's
:class:`~genlm_backend.llm.hf.rows.RowStrategy` says (with
``deterministic=True``, exact rows, their layout made on the device from the
same inputs and each row's first own token: where its levels end).

The graphs themselves, their memory pool and the captured function are
:mod:`~genlm_backend.llm.hf.capture`'s. Graphs are bounded in number and
storage (least recently used dropped) and
dropped when a level they read is evicted from the tree. Everything else
(prefill, multi-token passes, rows beyond the largest bucket, models whose
shared levels are unsupported) runs eagerly (:class:`~genlm_backend.llm.hf.runner.HFRunner`).
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from genlm_backend.cache.kv_block import KVBlock, KVEntry, Piece, Placement, Segment, int_tensor
from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.cache.plan import PassPlan, positions
from genlm_backend.llm.hf import capture
from genlm_backend.llm.hf.capture import CapturedStep, GraphKey, decode_one_token
from genlm_backend.llm.hf.compat import StaticCaches, cache_nbytes, kv_shape
from genlm_backend.llm.hf.rows import RowStrategy

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Row counts graphs are captured for: a step's rows are padded to the next one."""

MIN_STORAGE_BYTES = 2 << 30
"""The graphs' own-part storage bound under a smaller KV tree budget (see :class:`StepGraphs`)."""

SLOT_STEP = 128
"""Past 256 slots, a new graph's storage grows to the next multiple of this (see :func:`_num_slots`)."""


@dataclass(frozen=True)
class GraphStats:
    """A snapshot of a :class:`StepGraphs`."""

    num_captures: int
    num_replays: int
    num_graphs: int
    storage_bytes: int
    unsupported: str | None
    """Why steps run eagerly on this model (``None``: they are captured where the device can)."""


@dataclass(frozen=True)
class StepRow:
    """A row of a captured step: levels it reads, where its own part is in the graph's storage."""

    context: tuple[int, ...]
    split: int
    """Tokens read as levels."""
    parent: KVEntry | None
    levels: tuple[int, ...]
    """Indices of the step's levels the row reads."""
    first: int
    """Slot of the own part's first token in the row's storage."""
    copied: tuple[Segment, ...] | None
    """What is copied to slots ``first...``; ``None``: in place already."""

    @property
    def write_slot(self) -> int:
        return self.first + len(self.context) - 1 - self.split


@dataclass(frozen=True)
class GraphStep:
    """A one-token pass as a captured step, a value: the graph, its rows, and whether its storage is renewed."""

    key: GraphKey
    graph: CapturedStep | None
    """``None``: captured by this step."""
    levels: tuple[Piece, ...]
    rows: tuple[StepRow, ...]
    pad_slots: tuple[int, ...]
    """Slot each padding row writes (a free one)."""
    renews: bool
    pinned: tuple[KVEntry, ...]

    def placements(self) -> list[Placement]:
        """Where the tree finds each row's context in the graph's block."""
        return [
            Placement(row.context, i, row.first, row.split, row.parent)
            for i, row in enumerate(self.rows)
        ]

    def host_inputs(self, max_positions: int) -> torch.Tensor:
        """``int64 [6 + levels, R]`` on the host: the graph's inputs for this step."""
        pads = [0] * len(self.pad_slots)
        rows = self.rows
        fields = [
            [row.context[-1] for row in rows] + pads,
            [positions(len(row.context) - 1, 1, max_positions)[0] for row in rows] + pads,
            [row.write_slot for row in rows] + list(self.pad_slots),
            [row.first for row in rows] + list(self.pad_slots),
            [row.split for row in rows] + pads,
        ]
        fields += [[int(k in row.levels) for row in rows] + pads for k in range(len(self.levels))]
        return int_tensor(fields)


class StepGraphs:
    """The captured steps of one runner, by :class:`GraphKey`: plans one-token passes onto them and runs them.

    Args:
        model_of: The model to run (the runner's, which changes when adapters load).
        caches: The runner's ``StaticCache`` maker.
        kv_tree: Where the graphs' blocks are reserved and kept.
        vocab_size: Columns of the output.
        max_positions: The model's longest sequence.
        max_graphs: Most graphs kept (0: every step eager).
        max_storage_bytes: Most bytes of own-part storage kept by the graphs
            (beyond the tree's budget while the tree no longer holds them); ``None``:
            :data:`MIN_STORAGE_BYTES` or the tree's budget, whichever is larger, so that
            a long generation's rows stay captured as far as the tree could keep them.
        strategy: How the captured steps compute their rows (the runner's).
    """

    def __init__(
        self,
        model_of: Callable[[], Any],
        caches: StaticCaches,
        kv_tree: KVPrefixTree,
        vocab_size: int,
        max_positions: int,
        *,
        max_graphs: int = 8,
        max_storage_bytes: int | None = None,
        strategy: RowStrategy,
    ):
        self._model_of = model_of
        self._strategy = strategy
        self._caches = caches
        self._kv_tree = kv_tree
        self._vocab_size = vocab_size
        self._max_positions = max_positions
        self.max_graphs = max_graphs
        self.max_storage_bytes = (
            max(MIN_STORAGE_BYTES, kv_tree.budget_bytes)
            if max_storage_bytes is None
            else max_storage_bytes
        )
        self.unsupported: str | None = None
        """Why steps run eagerly (``None``: captured where the device can)."""
        self.can_capture = capture.graph_capture(model_of().device) is not None
        """Whether the model's device captures graphs (else every step runs eagerly)."""
        self._graphs: OrderedDict[GraphKey, CapturedStep] = OrderedDict()  # least recent first
        self._blocks: weakref.WeakSet[KVBlock] = weakref.WeakSet()
        """Blocks over a graph's storage, now or once: never a graph's level (their rows change)."""
        self._num_captures = 0
        self._num_replays = 0

    @property
    def stats(self) -> GraphStats:
        return GraphStats(
            self._num_captures,
            self._num_replays,
            len(self._graphs),
            sum(graph.nbytes for graph in self._graphs.values()),
            self.unsupported,
        )

    def clear(self) -> None:
        """Drop every graph (the model or its adapters changed)."""
        self._graphs.clear()

    def plan(self, pass_plan: PassPlan, namespace: Hashable) -> GraphStep | None:
        """The pass as a captured step, or ``None``: it runs eagerly."""
        num_rows = self._bucket(pass_plan)
        if num_rows is None:
            return None
        self._drop_evicted()
        splits = [self._split(pass_plan, i) for i in range(len(pass_plan.rows))]
        owns = [own for _, own in splits]
        levels = {_level_id(piece): piece for row_levels, _ in splits for piece in row_levels}
        level_ids = tuple(sorted(levels))
        family = [
            graph
            for key, graph in self._graphs.items()
            if (key.namespace, key.num_rows, key.levels) == (namespace, num_rows, level_ids)
        ]
        need = 1 + max(sum(segment.length for segment in own) for own in owns)
        graph, renews = self._choose(family, owns, num_rows, need)
        key = (
            graph.key if graph is not None else self._new_key(namespace, num_rows, need, level_ids)
        )
        if key is None:
            return None
        index = {level_id: k for k, level_id in enumerate(level_ids)}
        rows = tuple(
            _step_row(row.context, row_levels, own, index, graph, i, renews)
            for i, (row, (row_levels, own)) in enumerate(zip(pass_plan.rows, splits))
        )
        current = graph.current if graph is not None else None
        pads = range(len(rows), num_rows)
        return GraphStep(
            key,
            graph,
            tuple(levels[level_id] for level_id in level_ids),
            rows,
            tuple(0 if renews or current is None else current.row_ends[r] for r in pads),
            renews,
            tuple(entry for row in pass_plan.rows for entry, _ in row.levels + row.own),
        )

    def _bucket(self, pass_plan: PassPlan) -> int | None:
        """The rows a graph for the pass has, ``None`` if the pass runs eagerly."""
        if (
            pass_plan.num_new != 1
            or self.unsupported is not None
            or self.max_graphs < 1
            or any(len(row.reads) != 1 for row in pass_plan.rows)
            or capture.graph_capture(self._model_of().device) is None
        ):
            return None
        return next((bucket for bucket in ROW_BUCKETS if bucket >= len(pass_plan.rows)), None)

    def _new_key(self, namespace, num_rows: int, need: int, level_ids) -> GraphKey | None:
        """The key of a new graph for rows needing ``need`` slots, ``None`` if its storage is over the bound."""
        num_slots = min(_num_slots(need), self._max_positions)
        key = GraphKey(namespace, num_rows, num_slots, level_ids)
        if self._storage_nbytes(self._model_of(), key) > self.max_storage_bytes:
            return None
        return key

    def run(self, step: GraphStep) -> tuple[torch.Tensor, KVBlock] | None:
        """Run a planned step: ``float32 [rows, vocab_size]`` log-probabilities and the block written.

        ``None`` when the step could not be captured (then :attr:`unsupported`
        says why, and the pass is to run eagerly).
        """
        graph = step.graph
        if graph is None:
            model = self._model_of()
            storage = torch.zeros(
                self._storage_shape(model, step.key), dtype=model.dtype, device=model.device
            )
            graph = CapturedStep(step.key, storage, step.levels)
        if step.renews:
            # Held by the tree now: any pass of the batch may read it, even once evicted below.
            move = graph.current is not None and graph.current.num_live_entries > 0
            self._kv_tree.reserve(graph.nbytes, pinned=step.pinned)
            block = graph.renew(move)
            self._blocks.add(block)
            block.copy_in(_copies(step.rows))
        graph.load_inputs(step.host_inputs(self._max_positions))
        if graph.replay is None and not self._capture(graph):
            return None
        assert graph.replay is not None and graph.output is not None and graph.current is not None
        graph.replay()
        self._num_replays += 1
        self._graphs.move_to_end(graph.key)
        with torch.inference_mode(False):  # a tensor callers may write to
            rows = graph.output[: len(step.rows)].clone()
        return rows, graph.current

    def _capture(self, graph: CapturedStep) -> bool:
        model = self._model_of()
        graphs = capture.graph_capture(model.device)
        assert graphs is not None, "planned for a device that captures"
        try:
            graph.replay, graph.output = graphs.capture(
                functools.partial(
                    decode_one_token, model, self._caches, graph, self._vocab_size, self._strategy
                )
            )
        except RuntimeError as exc:  # a model doing host work inside its forward
            self.unsupported = f"capturing a one-token step failed: {exc}"
            return False
        self._num_captures += 1
        self._graphs[graph.key] = graph
        self._bound(keep=graph)
        return True

    def _split(self, pass_plan: PassPlan, i: int) -> tuple[tuple[Piece, ...], tuple[Segment, ...]]:
        """Row ``i``'s levels for a graph (the plan's, up to the first in a graph's storage) and own part."""
        row = pass_plan.rows[i]
        num_levels = 0
        while num_levels < len(row.levels) and row.levels[num_levels][0].block not in self._blocks:
            num_levels += 1
        own = [Segment(e.block, e.row, e.start, n) for e, n in row.levels[num_levels:]]
        skip = row.own_start  # the first own piece may begin at a level's end (exact rows)
        for e, n in row.own:
            own.append(Segment(e.block, e.row, e.start + skip, n - skip))
            skip = 0
        if pass_plan.extends is not None and row.num_own_past:
            start = pass_plan.num_past - row.num_own_past
            own.append(Segment(pass_plan.extends, i, start, row.num_own_past))
        return row.levels[:num_levels], tuple(own)

    @staticmethod
    def _choose(
        family: list[CapturedStep], owns: list[tuple[Segment, ...]], num_rows: int, need: int
    ) -> tuple[CapturedStep | None, bool]:
        """The graph for the step and whether its storage is renewed; ``None``: a new graph."""
        pads = range(len(owns), num_rows)
        for graph in family:
            current = graph.current
            if (
                current is not None
                and all(_in_place(graph, i, own, exact_end=True) for i, own in enumerate(owns))
                and all(current.row_ends[r] < graph.key.num_slots for r in pads)
            ):
                return graph, False
        fitting = [graph for graph in family if graph.key.num_slots >= need]
        if not fitting:
            return None, True
        return max(
            fitting,
            key=lambda graph: (
                sum(_in_place(graph, i, own, exact_end=False) for i, own in enumerate(owns)),
                -graph.key.num_slots,
            ),
        ), True

    def _drop_evicted(self) -> None:
        for key, graph in list(self._graphs.items()):
            if graph.reads_evicted_levels():
                del self._graphs[key]

    def _bound(self, keep: CapturedStep) -> None:
        """Drop least recently used graphs beyond the count and storage bounds (a block the tree holds keeps its storage)."""
        for key, graph in list(self._graphs.items()):
            storage = sum(other.nbytes for other in self._graphs.values())
            if len(self._graphs) <= self.max_graphs and storage <= self.max_storage_bytes:
                break
            if graph is not keep:
                del self._graphs[key]

    def _storage_shape(self, model, key: GraphKey) -> tuple[int, ...]:
        num_kv_heads, head_dim = kv_shape(model.config)
        return (self._caches.num_layers, 2, key.num_rows, num_kv_heads, key.num_slots, head_dim)

    def _storage_nbytes(self, model, key: GraphKey) -> int:
        num_layers, _, rows, heads, slots, head_dim = self._storage_shape(model, key)
        return cache_nbytes(num_layers, rows, heads, slots, head_dim, model.dtype)


def _step_row(
    context: tuple[int, ...],
    levels: tuple[Piece, ...],
    own: tuple[Segment, ...],
    index: dict[tuple[int, int, int, int], int],
    graph: CapturedStep | None,
    i: int,
    renews: bool,
) -> StepRow:
    """Row ``i`` of a step on ``graph`` (``None``: a new one): in place, or its own part copied to slot 0."""
    in_place = graph is not None and _in_place(graph, i, own, exact_end=not renews)
    return StepRow(
        context,
        sum(n for _, n in levels),
        levels[-1][0] if levels else None,
        tuple(index[_level_id(piece)] for piece in levels),
        own[0].start if in_place else 0,
        None if in_place else own,
    )


def _copies(rows: Sequence[StepRow]) -> list[tuple[int, int, Segment]]:
    """``(row, slot, segment)`` of every copied own part, each row's pieces in order from its first slot."""
    copies = []
    for i, row in enumerate(rows):
        slot = row.first
        for segment in row.copied or ():
            copies.append((i, slot, segment))
            slot += segment.length
    return copies


def _in_place(graph: CapturedStep, i: int, own: tuple[Segment, ...], exact_end: bool) -> bool:
    """Whether row ``i``'s own part is row ``i`` of the graph's current block, with a free slot after it.

    ``exact_end``: and nothing is written past it (the block is extended, not renewed).
    """
    current = graph.current
    if current is None or len(own) != 1:
        return False
    (segment,) = own
    end = segment.start + segment.length
    return (
        segment.block is current
        and segment.row == i
        and end < graph.key.num_slots
        and (not exact_end or current.row_ends[i] == end)
    )


def _level_id(piece: Piece) -> tuple[int, int, int, int]:
    entry, n = piece
    return (id(entry.block), entry.row, entry.start, n)


def _num_slots(need: int) -> int:
    """Slots of a new graph's storage, with 8 free slots or more past ``need``: a power of two
    (at least 32) up to 256, then the next multiple of :data:`SLOT_STEP`. Past 256 a move adds
    at most half the storage, not as much again: 64 rows of an 8B model (128 KiB a token each)
    need 3 GiB at 384 slots, where doubling asked for 4 GiB at 512."""
    if need + 8 <= 256:
        return 1 << max(5, (need + 7).bit_length())
    return -(-(need + 8) // SLOT_STEP) * SLOT_STEP
