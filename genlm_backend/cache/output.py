"""A byte-budgeted LRU cache of next-token log-probability rows."""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

MAX_GHOSTS = 1 << 15
"""Most evicted keys an :class:`OutputCache` remembers (a hash and a float each: about 4 MB):
the evicted rows of a 256 MiB budget beyond a 32 MiB limit, for a vocabulary of 8,000 tokens or
more; rows of nothing (a budget they never fill) are remembered no further."""


@dataclass(frozen=True)
class OutputCacheStats:
    """A snapshot of an :class:`OutputCache`."""

    num_entries: int
    num_hits: int
    num_misses: int
    num_evictions: int
    bytes_held: int
    budget_bytes: float
    limit_bytes: float
    """What the cache holds at most now: it grows towards ``budget_bytes`` as re-asked rows show a need."""


class OutputCache:
    """Least-recently-used map from a request key to a result tensor, within a byte budget.

    Thread-safe. Callers must copy before handing a cached tensor to user code.

    What it stores of a tensor it is given:

    * by default a compact copy of a view (e.g. one row of a ``[B, V]`` batch),
      so that the budget counts every byte the cache keeps alive and the
      batch's tensor stays the caller's to change;
    * with ``keep_views``, the view itself, its whole base tensor (the *block*)
      counted once while any of its rows is held: a batch's rows cost no copy
      (:meth:`put_rows` keeps the block and each row's index, and makes a row's
      view when it is asked for). The block is freed, and its bytes leave the
      count, when its last row is evicted: making room for bytes, the least
      recently used row goes with the rest of its block (dropping rows one by
      one would drop rows of several blocks and free nothing until a block's
      last). A block larger than the budget is
      never held (its rows are copied). The block's other holders may write to
      it: a row is dropped, as if never stored, once its block's version
      counter has moved (any in-place torch operation on the block or a view
      of it moves it; a write through ``.numpy()`` or DLPack does not, and is
      not seen).

    With ``initial_bytes``, the cache grows into its budget as the keys asked
    show a need for it, as an adaptive replacement cache sizes its lists by
    its ghost hits: it holds at most its *limit*, at first ``initial_bytes``
    (and always room for two of the largest storages it was given: a step's
    output and the last one's), and doubles the limit, up to the budget,
    whenever a lookup misses a key it evicted that the whole budget would
    still hold (it remembers the hashes of those keys, not the keys). Particles
    that each extend their own context never ask an older step's row again:
    their cache stays at the limit, and the process does not map a new
    step's worth of memory at every step until the whole budget is held. A
    workload that asks older rows again (a critic scoring earlier contexts)
    loses one miss per doubling.

    Also a mapping, as upstream genlm-backend's cache: ``cache[key] = tensor``,
    ``cache[key]`` (``KeyError`` when absent), ``key in cache``.

    Args:
        budget_bytes: Most bytes of tensor storage held (``0`` disables caching).
            Never exceeded: a tensor larger than the whole budget is not stored.
            ``None``: no byte limit (give ``maxsize``).
        maxsize: Most entries held, ``None`` for no count limit.
        move_to_cpu: Hold tensors in CPU memory and return them on the device they came from.
        keep_views: Hold views of their blocks instead of copies (see above).
        initial_bytes: The limit the cache starts from (see above); ``None``: the whole budget.

    Raises:
        ValueError: negative budget, maxsize or initial bytes, or neither limit given.
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        *,
        maxsize: int | None = None,
        move_to_cpu: bool = False,
        keep_views: bool = False,
        initial_bytes: int | None = None,
    ):
        if budget_bytes is None and maxsize is None:
            raise ValueError("give budget_bytes or maxsize")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if maxsize is not None and maxsize < 0:
            raise ValueError(f"maxsize must be >= 0, got {maxsize}")
        if initial_bytes is not None and initial_bytes < 0:
            raise ValueError(f"initial_bytes must be >= 0, got {initial_bytes}")
        self.budget_bytes = float("inf") if budget_bytes is None else int(budget_bytes)
        self._limit_bytes: float = (
            self.budget_bytes if initial_bytes is None else min(self.budget_bytes, initial_bytes)
        )
        # Hashes of keys evicted below the budget -> their share of their storage's bytes,
        # oldest first, as many as the budget beyond the limit would hold (_ghost_bytes).
        # Plain dicts here and below, in insertion order: a step's keys enter at C speed.
        self._ghosts: dict[int, float] = {}
        self._ghost_bytes = 0.0
        self.maxsize = maxsize
        self.move_to_cpu = move_to_cpu
        self.keep_views = keep_views
        # Entries are held by their key's hash, an int, and the key beside it: a key's
        # Python-level __hash__ (a request's) runs once a lookup and once a store, not at
        # every dict and set operation on it. A key whose hash another held key has
        # replaces it (two keys of one 64-bit hash: one is held).
        # hash -> (storage address, row): row >= 0 is a row of the block held at that
        # address; row < 0, the tensor in _tensors. Tuples of ints: the garbage collector
        # stops tracking them, so a full cache costs a collection nothing per row.
        # In use order, least recent first (a hit is popped and inserted again).
        self._entries: dict[int, tuple[int, int]] = {}
        self._keys: dict[int, Hashable] = {}
        self._devices: dict[int, torch.device] = {}  # of entries moved to the CPU
        self._tensors: dict[int, torch.Tensor] = {}
        self._versions: dict[int, int] = {}  # of views in _tensors: their block's then
        # storage address -> [bytes, hashes of its entries, block tensor or None, its version]
        self._blocks: dict[int, list] = {}
        self._bytes_held = 0
        self._lock = threading.Lock()
        self._num_hits = self._num_misses = self._num_evictions = 0

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The tensor stored under ``key`` (marked most recently used), or ``None``."""
        return self.get_many([key])[0]

    def get_many(
        self, keys: Sequence[Hashable], count_misses: bool = True
    ) -> list[torch.Tensor | None]:
        """:meth:`get` for each of ``keys``, in order, under one acquisition of the lock.

        ``count_misses=False``: a key not held is not counted as a miss (a caller
        whose misses go on to a step that looks them up again, and counts them there).
        """
        values: list[torch.Tensor | None] = [None] * len(keys)
        hashes = list(map(hash, keys))
        with self._lock:
            entries = self._entries
            held = list(map(entries.get, hashes))  # an entry is a pair: true when found
            if self._ghosts and not all(held):
                self._grow_if_evicted([h for h, entry in zip(hashes, held) if entry is None])
            num_hits = 0
            if any(held):  # else (a step's new contexts) no key is looked at again
                for i, (h, entry) in enumerate(zip(hashes, held)):
                    if entry is None:
                        continue
                    key, stored = keys[i], self._keys[h]
                    if stored is not key and stored != key:
                        continue  # another key of its hash
                    value = self._value(h, entry)
                    if value is None:
                        self._drop(h, evicted=False)  # its block was written to since
                        continue
                    entries[h] = entries.pop(h)  # the most recently used
                    values[i] = value
                    num_hits += 1
            self._num_hits += num_hits
            if count_misses:
                self._num_misses += len(values) - num_hits
            devices = self._devices
            if not devices:
                return values
            return [
                value if value is None or h not in devices else value.to(devices[h])
                for h, value in zip(hashes, values)
            ]

    def _grow_if_evicted(self, missed: Iterable[int]) -> None:
        """Double the limit (up to the budget) if one of the keys of hashes ``missed`` was evicted
        within what the budget would hold; past the budget, no evicted key is remembered (lock held)."""
        ghosts = self._ghosts
        found = [ghost for ghost in missed if ghost in ghosts]
        if not found:
            return
        for ghost in found:
            self._ghost_bytes -= ghosts.pop(ghost)
        self._limit_bytes = min(self.budget_bytes, 2 * self._limit_bytes)
        self._forget_ghosts()

    def _room_for(self, nbytes: int) -> None:
        """Raise the limit to hold two storages of ``nbytes`` (a step's output and the last
        one's), up to the budget (lock held)."""
        if 2 * nbytes > self._limit_bytes:
            self._limit_bytes = min(self.budget_bytes, 2 * nbytes)
            self._forget_ghosts()

    def _remember_evicted(self, hashes: Iterable[int], nbytes: float) -> None:
        """Remember ``hashes``, of keys evicted from a storage of ``nbytes``, while the limit is
        below the budget (lock held)."""
        if self._limit_bytes >= self.budget_bytes:
            return
        hashes = list(hashes)
        share = nbytes / max(1, len(hashes))
        ghosts = self._ghosts
        for ghost in ghosts.keys() & hashes:  # evicted before: remembered anew, as the newest
            self._ghost_bytes -= ghosts.pop(ghost)
        ghosts.update(zip(hashes, itertools.repeat(share)))  # each a C-level step
        self._ghost_bytes += share * len(hashes)
        self._forget_ghosts()

    def _forget_ghosts(self) -> None:
        """Forget the oldest ghosts beyond what the budget would hold past the limit, and beyond
        :data:`MAX_GHOSTS` (lock held)."""
        ghosts = self._ghosts
        excess_bytes = self._ghost_bytes - (self.budget_bytes - self._limit_bytes)
        excess_count = len(ghosts) - MAX_GHOSTS
        if excess_bytes <= 0 and excess_count <= 0:
            return
        forgotten: list[int] = []
        forgotten_bytes = 0.0
        for ghost, share in ghosts.items():  # oldest first
            if forgotten_bytes >= excess_bytes and len(forgotten) >= excess_count:
                break
            forgotten.append(ghost)
            forgotten_bytes += share
        _drain(map(ghosts.pop, forgotten))
        self._ghost_bytes = self._ghost_bytes - forgotten_bytes if ghosts else 0.0

    def _value(self, h: int, entry: tuple[int, int]) -> torch.Tensor | None:
        """The tensor of the entry of hash ``h``, ``None`` if its block was written to since it
        was stored."""
        address, row = entry
        if row >= 0:
            _, _, block, version = self._blocks[address]
            return block[row] if version is None or block._version == version else None
        value = self._tensors[h]
        version = self._versions.get(h)
        return value if version is None or value._version == version else None

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
                storage = value.untyped_storage()
                self._room_for(storage.nbytes())
                h = self._store(key, storage.data_ptr(), -1, storage.nbytes(), None)
                self._tensors[h] = value
                if _tracks_writes(value):
                    self._versions[h] = value._version
                if device is not None:
                    self._devices[h] = device

    def put_rows(
        self, keys: Sequence[Hashable], rows: Sequence[torch.Tensor], block: torch.Tensor
    ) -> None:
        """:meth:`put_many` of ``zip(keys, rows)``, where ``rows`` are the rows of ``block``
        (``rows = block.unbind(0)``): with ``keep_views``, the block is held once with the
        index of each key's row."""
        storage = block.untyped_storage()
        nbytes = storage.nbytes()
        if not self.keep_views or self.move_to_cpu or nbytes > self.budget_bytes:
            self.put_many(list(zip(keys, rows)))
            return
        if self.maxsize == 0:
            return
        address = storage.data_ptr()
        version = block._version if not block.is_inference() else None
        with self._lock:
            self._room_for(nbytes)
            held = self._blocks.get(address)
            if held is not None and held[2] is not block:
                # The memory of rows held is the runner's output again: those rows are stale.
                self._drop_block(address)
            if not self._put_new_block(keys, address, nbytes, (block, version)):
                for row, key in enumerate(keys):
                    self._store(key, address, row, nbytes, (block, version))

    def _put_new_block(
        self,
        keys: Sequence[Hashable],
        address: int,
        nbytes: int,
        block: tuple[torch.Tensor, int | None],
    ) -> bool:
        """:meth:`_store` of every key at once, for a block not held whose keys are all new
        (a step's fresh output): room made once, the entries added together; ``False``
        (nothing done) otherwise (lock held)."""
        entries, maxsize = self._entries, self.maxsize
        hashes = list(map(hash, keys))
        unique = set(hashes)
        if len(unique) != len(keys) or (maxsize is not None and len(keys) > maxsize):
            return False
        if address in self._blocks or not entries.keys().isdisjoint(unique):
            return False
        while entries:
            if self._bytes_held + nbytes > self._limit_bytes:
                self._evict_oldest(whole_block=True)
            elif maxsize is not None and len(entries) + len(keys) > maxsize:
                self._evict_oldest(whole_block=False)
            else:
                break
        self._blocks[address] = [nbytes, unique, *block]
        self._bytes_held += nbytes
        entries.update(zip(hashes, zip(itertools.repeat(address), range(len(keys)))))
        self._keys.update(zip(hashes, keys))
        return True

    def _copies(self, value: torch.Tensor) -> bool:
        """Whether ``value`` is stored as a compact copy rather than as it is."""
        storage_nbytes = value.untyped_storage().nbytes()
        if self.keep_views:
            return storage_nbytes > self.budget_bytes
        return value._base is not None or storage_nbytes > _nbytes(value)

    def _store(
        self,
        key: Hashable,
        address: int,
        row: int,
        nbytes: int,
        block: tuple[torch.Tensor, int | None] | None,
    ) -> int:
        """Hold ``key``'s entry ``(address, row)``, whose storage is ``nbytes`` at ``address``
        (``block``: the tensor held there and its version, for a row of it), evicting to
        make room (lock held); returns the key's hash."""
        h = hash(key)
        self._drop(h, evicted=False)
        held = self._blocks.get(address)
        size = 0 if held is not None else nbytes
        while self._entries:
            if self._bytes_held + size > self._limit_bytes:
                self._evict_oldest(whole_block=True)
            elif self.maxsize is not None and len(self._entries) >= self.maxsize:
                self._evict_oldest(whole_block=False)
            else:
                break
            held = self._blocks.get(address)  # the eviction may have freed this very block
            size = 0 if held is not None else nbytes
        if held is None:
            held = self._blocks[address] = [nbytes, set(), None, None]
            self._bytes_held += nbytes
        if block is not None and held[2] is None:
            held[2], held[3] = block
        held[1].add(h)
        self._entries[h] = (address, row)
        self._keys[h] = key
        return h

    def _drop(self, h: int, evicted: bool) -> None:
        """Forget the entry of hash ``h``, if any; its block goes with its last row (lock held)."""
        entry = self._entries.pop(h, None)
        if entry is None:
            return
        del self._keys[h]
        self._devices.pop(h, None)
        self._num_evictions += evicted
        address, row = entry
        if row < 0:
            del self._tensors[h]
            self._versions.pop(h, None)
        held = self._blocks[address]
        held[1].discard(h)
        if evicted:
            self._remember_evicted((h,), held[0] if row < 0 else held[0] / (len(held[1]) + 1))
        if not held[1]:
            del self._blocks[address]
            self._bytes_held -= held[0]

    def _evict_oldest(self, whole_block: bool) -> None:
        """Evict the least recently used entry; with ``whole_block``, a row goes with the rest
        of its block, whose bytes go only with its last row (lock held)."""
        h = next(iter(self._entries))
        address, row = self._entries[h]
        if whole_block and row >= 0:
            nbytes, hashes, _, _ = self._blocks[address]
            self._num_evictions += len(hashes)
            self._remember_evicted(hashes, nbytes)
            self._drop_block(address)
        else:
            self._drop(h, evicted=True)

    def _drop_block(self, address: int) -> None:
        """Forget every entry of the block held at ``address``, and the block (lock held):
        :meth:`_drop` of each, in one pass."""
        nbytes, hashes, _, _ = self._blocks.pop(address)
        self._bytes_held -= nbytes
        # Each a C-level loop over the block's entries (a step's rows).
        _drain(map(self._entries.pop, hashes))
        _drain(map(self._keys.pop, hashes))
        for of_entries in (self._tensors, self._versions, self._devices):
            if of_entries:  # tensors of their own at this address
                _drain(map(of_entries.pop, hashes, itertools.repeat(None)))

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
            doomed = [h for h, key in self._keys.items() if predicate(key)]
            for h in doomed:
                self._drop(h, evicted=False)
        return len(doomed)

    def keys(self) -> list[Hashable]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(map(self._keys.__getitem__, self._entries))

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.keys())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._keys.clear()
            self._tensors.clear()
            self._versions.clear()
            self._devices.clear()
            self._blocks.clear()
            self._bytes_held = 0
            self._ghosts.clear()
            self._ghost_bytes = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        stored = self._keys.get(hash(key), _ABSENT)
        return stored is key or (stored is not _ABSENT and stored == key)

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
                limit_bytes=self._limit_bytes,
            )


_ABSENT = object()
_drain: Callable[[Iterable], None] = collections.deque(maxlen=0).extend
"""Exhausts an iterator at C speed."""


def _tracks_writes(value: torch.Tensor) -> bool:
    """Whether ``value`` is a view whose block's writes torch counts (not an inference tensor)."""
    return value._base is not None and not value.is_inference()


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
