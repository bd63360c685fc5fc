"""Captured steps: CUDA graphs and their memory pool, and what one graph reads and writes.

:func:`graph_capture` says how a device captures (CUDA graphs on a CUDA
device, none elsewhere; the tests emulate graphs on CPU,
``tests/graph_emulation.py``). A :class:`CapturedStep` is one graph with its
own-part storage, its inputs (every per-step value, as device data) and its
output; :func:`decode_one_token` is the function captured: one token per row,
every per-step value read from the graph's inputs. Which graph a step runs on,
and what it copies first, is :mod:`~genlm_backend.llm.hf.graphs`'s plan.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from genlm_backend.cache.kv_block import KVBlock, Piece
from genlm_backend.llm.hf.attention import Level
from genlm_backend.llm.hf.compat import StaticCaches, attending, grouped_kv_attention
from genlm_backend.llm.hf.rows import RowStrategy
from genlm_backend.llm.runner import fit_to_vocab
from genlm_backend.tokenization.token import gc_paused

_TOKENS, _POSITIONS, _WRITES, _FIRSTS, _SPLITS, _LEVELS = range(6)
"""Rows of a graph's ``inputs``; one more per level (1 where the row reads it)."""


class GraphCapture(Protocol):
    """Captures a step: ``(replay, output)``, the output tensor each replay writes."""

    def capture(
        self, step: Callable[[], torch.Tensor]
    ) -> tuple[Callable[[], None], torch.Tensor]: ...


class CudaGraphs:
    """Captures steps on one CUDA device as ``torch.cuda.CUDAGraph``\\ s sharing one memory pool.

    The pool is a ``torch.cuda.MemPool`` this object holds for as long as it
    lives (the process: one per device). A pool named only by a
    ``graph_pool_handle`` is released once the last graph captured into it is
    destroyed, and every later capture into that handle fails inside torch's
    allocator (``use_count > 0``): a process whose graphs were all dropped
    (evictions, adapter changes, closed runners) could then capture nothing.

    A capture must not see work it did not ask for. Other threads' CUDA calls
    (the event loop's thread draws tokens from CUDA rows while the worker
    captures) are allowed by the ``thread_local`` capture mode; in the default
    ``global`` mode a host synchronisation in any thread invalidates the
    capture. Python's cyclic garbage collector is paused during a capture: a
    collection there can destroy an unreachable runner's graphs, whose CUDA
    calls would invalidate the capture from its own thread. One capture at a
    time in the process (torch's rule), across devices and runners. A capture
    that fails leaves torch's allocator still recording into its pool, which
    then refuses every later capture: the pool is set aside (kept, never
    freed) and the next capture gets a new one.
    """

    def __init__(self, index: int | None):
        self._index = index
        self._pool: Any = None  # a pool handle: torch types it apart from a plain tuple
        self._pool_owner: Any = None  # the torch.cuda.MemPool behind _pool
        self._abandoned: list[Any] = []  # pools a failed capture left recording

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with _CAPTURE_LOCK, torch.cuda.device(self._index), gc_paused():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()  # warm-up: lazy initialisations (libraries, workspaces) happen outside the graph
            torch.cuda.current_stream().wait_stream(stream)
            pool = self._shared_pool()
            try:
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    output = step()
            except BaseException:
                self._abandon_pool()
                raise
        return graph.replay, output

    def _shared_pool(self) -> Any:
        if self._pool is None:
            if not hasattr(torch.cuda, "MemPool"):  # torch before MemPool: a pool per graph
                return torch.cuda.graph_pool_handle()
            self._pool_owner = torch.cuda.MemPool()
            self._pool = self._pool_owner.id
        return self._pool

    def _abandon_pool(self) -> None:
        if self._pool_owner is not None:
            self._abandoned.append(self._pool_owner)
        self._pool = self._pool_owner = None


_CAPTURE_LOCK = threading.Lock()
"""Held by every capture of the process: torch allows one at a time."""


@functools.cache
def _cuda_graphs(index: int | None) -> CudaGraphs:
    return CudaGraphs(index)


def graph_capture(device: torch.device) -> GraphCapture | None:
    """How steps on ``device`` are captured: CUDA graphs on a CUDA device, else ``None`` (eager steps)."""
    return _cuda_graphs(device.index) if device.type == "cuda" else None


@dataclass(frozen=True)
class GraphKey:
    """What a captured step's operations depend on besides its inputs."""

    namespace: Hashable
    num_rows: int
    num_slots: int
    levels: tuple[tuple[int, int, int, int], ...]
    """``(id(block), row, start, length)`` of each level, sorted."""


class CapturedStep:
    """A graph and what it reads and writes: its own-part storage, inputs and output.

    ``current`` is the tree's block over the storage now (``None`` before the first step).
    """

    def __init__(self, key: GraphKey, storage: torch.Tensor, levels: Sequence[Piece]):
        self.key = key
        self.storage = storage  # [L, 2, R, H, T, D]
        self.inputs = torch.zeros(
            _LEVELS + len(levels), key.num_rows, dtype=torch.long, device=storage.device
        )
        self.levels = [Level(entry.block, entry.row, entry.start, n, None) for entry, n in levels]
        self.offsets = [entry.offset for entry, _ in levels]
        """Each level's first token in its rows' contexts."""
        self.replay: Callable[[], None] | None = None
        self.output: torch.Tensor | None = None
        self.current: KVBlock | None = None
        self._staging: torch.Tensor | None = None  # pinned, on CUDA
        self._copied: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def reads_evicted_levels(self) -> bool:
        return any(level.block.num_live_entries == 0 for level in self.levels)

    def renew(self, move: bool) -> KVBlock:
        """A new block over the storage; with ``move``, the current one keeps its contents in a copy."""
        if move and self.current is not None:
            self.current.move_to(self.storage.clone())
        self.current = KVBlock(self.storage)
        return self.current

    def load_inputs(self, host: torch.Tensor) -> None:
        """Fill :attr:`inputs` from ``host`` (the same shape): the step's one host-to-device copy.

        On CUDA the copy goes through a pinned buffer without waiting for the
        device, once the previous step's copy out of that buffer is done.
        """
        if self.inputs.device.type != "cuda":
            self.inputs.copy_(host)
            return
        if self._staging is None or self._copied is None:
            self._staging = torch.empty_like(host).pin_memory()
            self._copied = torch.cuda.Event()
        else:
            self._copied.synchronize()
        self._staging.copy_(host)
        self.inputs.copy_(self._staging, non_blocking=True)
        self._copied.record()


def decode_one_token(
    model,
    caches: StaticCaches,
    graph: CapturedStep,
    vocab_size: int,
    strategy: RowStrategy,
) -> torch.Tensor:
    """The captured step: one token per row, every per-step value read from ``graph.inputs``.

    Its attention and products are ``strategy``'s (with ``deterministic=True``,
    exact rows: a row has the bits of its context computed alone).

    Returns ``float32 [R, vocab_size]`` log-probabilities (padding rows included).
    """
    inputs, storage = graph.inputs, graph.storage  # [6 + levels, R]; [L, 2, R, H, T, D]
    writes, firsts = inputs[_WRITES], inputs[_FIRSTS]
    slots = torch.arange(storage.shape[4], device=storage.device)
    hidden = (slots < firsts[:, None]) | (slots > writes[:, None])  # [R, T]
    mask = torch.zeros(hidden.shape, dtype=storage.dtype, device=storage.device)
    mask = mask.masked_fill_(hidden, torch.finfo(storage.dtype).min)[:, None, None]  # [R, 1, 1, T]
    bias = torch.zeros(len(graph.levels), inputs.shape[1], device=storage.device)
    bias = bias.masked_fill_(inputs[_LEVELS:] == 0, float("-inf"))  # [levels, R]
    levels = [dataclasses.replace(level, row_bias=bias[k]) for k, level in enumerate(graph.levels)]
    layers = [(layer[0], layer[1]) for layer in storage.unbind(0)]
    config = model.config.get_text_config(decoder=True)
    num_groups = config.num_attention_heads // storage.shape[3]
    attention = strategy.step_attention(
        levels, graph.offsets, (inputs[_SPLITS], firsts, writes), num_groups, storage.shape[4]
    )
    with grouped_kv_attention(config), attending(attention), strategy.products(model):
        output = model(
            input_ids=inputs[_TOKENS, :, None],
            attention_mask=mask,
            position_ids=inputs[_POSITIONS, :, None],
            past_key_values=caches.scattered(layers, writes),
            use_cache=True,
            logits_to_keep=1,
        )
    return fit_to_vocab(output.logits[:, 0], vocab_size)
