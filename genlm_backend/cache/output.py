"""A byte-budgeted LRU cache of next-token log-probability rows."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutputCacheStats:
    """A snapshot of an :class:`OutputCache`."""

    num_entries: int
    num_hits: int
    num_misses: int
    num_evictions: int
    bytes_held: int
    budget_bytes: float


class OutputCache:
    """Least-recently-used map from a request key to a result tensor, within a byte budget.

    Thread-safe. Callers must copy before handing a cached tensor to user code.

    What it stores of a tensor it is given:

    * by default a compact copy of a view (e.g. one row of a ``[B, V]`` batch),
      so that the budget counts every byte the cache keeps alive and the
      batch's tensor stays the caller's to change;
    * with ``keep_views``, the view itself, its whole base tensor (the *block*)
      counted once while any of its rows is held: a batch's rows cost no copy.
      The block is freed, and its bytes leave the count, when its last row is
      evicted. Nobody may change a block whose rows the cache holds; a block
      larger than the budget is never held (its rows are copied).

    Also a mapping, as upstream genlm-backend's cache: ``cache[key] = tensor``,
    ``cache[key]`` (``KeyError`` when absent), ``key in cache``.

    Args:
        budget_bytes: Most bytes of tensor storage held (``0`` disables caching).
            Never exceeded: a tensor larger than the whole budget is not stored.
            ``None``: no byte limit (give ``maxsize``).
        maxsize: Most entries held, ``None`` for no count limit.
        move_to_cpu: Hold tensors in CPU memory and return them on the device they came from.
        keep_views: Hold views of their blocks instead of copies (see above).

    Raises:
        ValueError: negative budget or maxsize, or neither limit given.
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        *,
        maxsize: int | None = None,
        move_to_cpu: bool = False,
        keep_views: bool = False,
    ):
        if budget_bytes is None and maxsize is None:
            raise ValueError("give budget_bytes or maxsize")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if maxsize is not None and maxsize < 0:
            raise ValueError(f"maxsize must be >= 0, got {maxsize}")
        self.budget_bytes = float("inf") if budget_bytes is None else int(budget_bytes)
        self.maxsize = maxsize
        self.move_to_cpu = move_to_cpu
        self.keep_views = keep_views
        self._devices: dict[Hashable, torch.device] = {}  # of entries moved to the CPU
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._blocks: dict[int, list[int]] = {}  # storage address -> [bytes, rows held]
        self._bytes_held = 0
        self._lock = threading.Lock()
        self._num_hits = self._num_misses = self._num_evictions = 0

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The tensor stored under ``key`` (marked most recently used), or ``None``."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[Hashable]) -> list[torch.Tensor | None]:
        """:meth:`get` for each of ``keys``, in order, under one acquisition of the lock."""
        with self._lock:
            entries = self._entries
            values = [entries.get(key) for key in keys]
            num_hits = 0
            for key, value in zip(keys, values):
                if value is not None:
                    entries.move_to_end(key)
                    num_hits += 1
            self._num_hits += num_hits
            self._num_misses += len(values) - num_hits
            if not self._devices:
                return values
            return [
                value if value is None or key not in self._devices else value.to(self._devices[key])
                for key, value in zip(keys, values)
            ]

    def put(self, key: Hashable, value: torch.Tensor) -> None:
        """Store ``value``, evicting least recently used entries to stay within budget."""
        self.put_many([(key, value)])

    def put_many(self, items: Sequence[tuple[Hashable, torch.Tensor]]) -> None:
        """:meth:`put` each ``(key, value)`` in order; the copies made are made together.

        The rows of a batch are views of its ``[B, V]`` output. Copied (without
        ``keep_views``), on a CUDA device they are one multi-tensor kernel
        (``torch._foreach_copy_``) instead of a launch per row.
        """
        if self.budget_bytes <= 0 or self.maxsize == 0:
            return  # nothing can be stored
        kept = []
        for key, value in items:
            if _nbytes(value) > self.budget_bytes:
                continue
            device = None
            if self.move_to_cpu and value.device.type != "cpu":
                device, value = value.device, value.cpu()
            kept.append((key, value, device))
        copied = [i for i, (_, value, _) in enumerate(kept) if self._copies(value)]
        for i, copy in zip(copied, compact_copies([kept[i][1] for i in copied])):
            key, _, device = kept[i]
            kept[i] = (key, copy, device)
        with self._lock:
            for key, value, device in kept:
                self._store(key, value, device)

    def _copies(self, value: torch.Tensor) -> bool:
        """Whether ``value`` is stored as a compact copy rather than as it is."""
        storage_nbytes = value.untyped_storage().nbytes()
        if self.keep_views:
            return storage_nbytes > self.budget_bytes
        return value._base is not None or storage_nbytes > _nbytes(value)

    def _store(self, key: Hashable, value: torch.Tensor, device: torch.device | None) -> None:
        """Hold ``value`` under ``key`` (lock held), evicting to make room."""
        self._drop(key, evicted=False)
        block = value.untyped_storage()
        address, nbytes = block.data_ptr(), block.nbytes()
        held = self._blocks.get(address)
        size = 0 if held is not None else nbytes
        while self._entries and (
            self._bytes_held + size > self.budget_bytes
            or (self.maxsize is not None and len(self._entries) >= self.maxsize)
        ):
            self._drop(next(iter(self._entries)), evicted=True)
            held = self._blocks.get(address)  # the eviction may have freed this very block
            size = 0 if held is not None else nbytes
        if held is None:
            held = self._blocks[address] = [nbytes, 0]
            self._bytes_held += nbytes
        held[1] += 1
        self._entries[key] = value
        if device is not None:
            self._devices[key] = device

    def _drop(self, key: Hashable, evicted: bool) -> None:
        """Forget ``key``'s entry, if any; its block goes with its last row (lock held)."""
        value = self._entries.pop(key, None)
        if value is None:
            return
        self._devices.pop(key, None)
        self._num_evictions += evicted
        address = value.untyped_storage().data_ptr()
        held = self._blocks[address]
        held[1] -= 1
        if held[1] == 0:
            del self._blocks[address]
            self._bytes_held -= held[0]

    def __getitem__(self, key: Hashable) -> torch.Tensor:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: Hashable, value: torch.Tensor) -> None:
        self.put(key, value)

    def discard_if(self, predicate: Callable[[Hashable], bool]) -> int:
        """Drop every entry whose key satisfies ``predicate``; returns how many were dropped."""
        with self._lock:
            doomed = [key for key in self._entries if predicate(key)]
            for key in doomed:
                self._drop(key, evicted=False)
        return len(doomed)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._devices.clear()
            self._blocks.clear()
            self._bytes_held = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @property
    def stats(self) -> OutputCacheStats:
        with self._lock:
            return OutputCacheStats(
                num_entries=len(self._entries),
                num_hits=self._num_hits,
                num_misses=self._num_misses,
                num_evictions=self._num_evictions,
                bytes_held=self._bytes_held,
                budget_bytes=self.budget_bytes,
            )


def _nbytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def compact_copies(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A contiguous copy of each of ``values``: those on CUDA devices by multi-tensor
    kernels (one per device and dtype), the others one by one."""
    copies = [torch.empty_like(value, memory_format=torch.contiguous_format) for value in values]
    on_cuda = [i for i, value in enumerate(values) if value.device.type == "cuda"]
    if on_cuda:
        torch._foreach_copy_([copies[i] for i in on_cuda], [values[i] for i in on_cuda])
    for copy, value in zip(copies, values):
        if value.device.type != "cuda":
            copy.copy_(value)
    return copies
