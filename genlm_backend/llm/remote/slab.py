"""Rows through shared memory: a client's slab, which the server writes its answers into.

A slab is one POSIX shared-memory segment (:mod:`multiprocessing.shared_memory`)
that a client creates and a server on the same machine maps. Layout::

    [0, HEADER_BYTES)   header: the client's random nonce (NONCE_BYTES), then zeros
    [HEADER_BYTES, ...) rows: float32 [capacity_rows, vocab_size], C order, native byte order

The nonce makes the same-machine check robust: a server accepts a slab only if
it can open the segment by name *and* finds there the nonce the client sent
in its offer, so a name that happens to exist on another machine is refused.

Lifetime: the client unlinks the segment's name as soon as the server has
mapped it (:meth:`Slab.unlink`); from then on the memory is held only by the
two mappings and freed by the kernel when both are gone, so a killed client
or server leaves nothing in ``/dev/shm``. Pages are reserved at creation
(``posix_fallocate``): a full ``/dev/shm`` fails there, with ``OSError``,
rather than as a ``SIGBUS`` in the server's write.

Views of the segment through :class:`Slab` are numpy arrays made for one copy
and dropped at once: a mapping cannot be closed while one is alive
(``BufferError``), which is the guard against reading unmapped memory. Views
that outlive a copy (rows a client lends to the tensors it returns) go
through a mapping of their own, :meth:`Slab.lending_map`, held by them alone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import sys
import threading
from collections.abc import Sequence
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

HEADER_BYTES = 64
"""Bytes before the first row (the nonce, padded): rows start 64-byte aligned."""
NONCE_BYTES = 16
NAME_PREFIX = "genlm-serve-"
"""Every slab's segment name starts with this (``/dev/shm/genlm-serve-*`` on Linux)."""


class SlabRefused(Exception):
    """A server cannot use the slab a client offered (another machine, wrong nonce, wrong size)."""


def slab_bytes(capacity_rows: int, vocab_size: int) -> int:
    """Size of a slab holding ``capacity_rows`` rows of ``vocab_size`` float32."""
    return HEADER_BYTES + 4 * capacity_rows * vocab_size


class Slab:
    """One shared-memory segment of rows, as a client created it or a server mapped it.

    Not thread-safe: a client reads and closes it under its ``AsyncLM``'s
    compute lock, a server writes and closes it on its event loop.
    """

    def __init__(self, shm: SharedMemory, capacity_rows: int, vocab_size: int, nonce: bytes):
        self._shm = shm
        self.capacity_rows = capacity_rows
        self.vocab_size = vocab_size
        self.nonce = nonce
        self.is_closed = False
        self.pinned_address: int | None = None
        """Where the mapping is page-locked for CUDA copies (``None``: it is not)."""
        self._pin_tried = False
        self._pinned_for: torch.device | None = None

    @property
    def name(self) -> str:
        return self._shm.name

    @classmethod
    def create(cls, capacity_rows: int, vocab_size: int) -> Slab:
        """A new slab (the client's), its pages reserved and its nonce written.

        Raises:
            OSError: no shared memory here, or not enough of it (e.g. a small ``/dev/shm``).
        """
        size = slab_bytes(capacity_rows, vocab_size)
        shm = SharedMemory(name=NAME_PREFIX + secrets.token_hex(12), create=True, size=size)
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            _reserve_pages(shm)
            _buffer(shm)[:NONCE_BYTES] = nonce
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        return cls(shm, capacity_rows, vocab_size, nonce)

    @classmethod
    def attach(cls, name: str, nonce: bytes, capacity_rows: int, vocab_size: int) -> Slab:
        """Map a client's slab (the server's side) after checking it is the one offered.

        Raises:
            SlabRefused: the message says why (no such segment here, too small, another nonce).
        """
        if not name.startswith(NAME_PREFIX) or "/" in name or len(name) > 64:
            raise SlabRefused(f"not a slab name: {name!r}")
        try:
            shm = _open_untracked(name)
        except (
            OSError
        ) as exc:  # FileNotFoundError on another machine, PermissionError for another user
            raise SlabRefused(f"cannot open shared memory {name!r} here ({exc.strerror})") from None
        slab = cls(shm, capacity_rows, vocab_size, nonce)
        if shm.size < slab_bytes(capacity_rows, vocab_size):
            slab.close()
            raise SlabRefused(f"shared memory {name!r} is smaller than {capacity_rows} rows")
        if bytes(_buffer(shm)[:NONCE_BYTES]) != nonce:
            slab.close()
            raise SlabRefused(f"shared memory {name!r} does not hold the offered nonce")
        return slab

    def write(self, rows: Sequence[torch.Tensor], first_row: int = 0) -> None:
        """Copy ``rows`` (float32 ``[vocab_size]`` each, any device) into the slab from row ``first_row`` on."""
        target = self._view(len(rows), first_row)  # [n, V]
        if all(row.device.type == "cpu" for row in rows):
            # numpy's copy runs in this thread: torch's would start its OpenMP team for
            # a memcpy, which waits for cores the model's threads hold.
            np.stack([row.detach().numpy() for row in rows], out=target)
        else:
            if rows[0].device.type == "cuda":
                self._pin(rows[0].device)
            torch.from_numpy(target).copy_(torch.stack(list(rows)))
        del target

    def _pin(self, device: torch.device) -> None:
        """Page-lock this mapping for CUDA (once; the server's side, before its first CUDA rows).

        A device-to-host copy into pageable memory goes through a staging
        buffer in pieces; into page-locked memory the copy engine writes it
        directly. A refusal (no more lockable memory) leaves it pageable.
        """
        if self._pin_tried:
            return
        self._pin_tried = True
        buffer = _buffer(self._shm)
        address = np.frombuffer(buffer, np.uint8).ctypes.data  # the view goes at once
        portable = 1  # cudaHostRegisterPortable: locked for every device
        status = _cuda_call_apart(
            device, torch.cuda.cudart().cudaHostRegister, address, len(buffer), portable
        )
        if status == 0:
            self.pinned_address, self._pinned_for = address, device

    def read(self, num_rows: int, first_row: int = 0) -> torch.Tensor:
        """A fresh ``float32`` ``[num_rows, vocab_size]`` CPU tensor: the slab's rows from
        ``first_row`` on, copied once."""
        return torch.from_numpy(self._view(num_rows, first_row).copy())

    def lending_map(self) -> mmap.mmap:
        """A second mapping of the slab, for views that may outlive this object.

        Views of it hold it (and so the memory) until the last of them goes;
        :meth:`close` does not wait for them.
        """
        if self.is_closed:
            raise ValueError("this slab is closed")
        fd = self._shm._fd  # type: ignore[attr-defined]  # SharedMemory's descriptor on POSIX
        return mmap.mmap(fd, self._shm.size)  # mmap keeps a descriptor of its own

    def _view(self, num_rows: int, first_row: int = 0) -> np.ndarray:
        if self.is_closed:
            raise ValueError("this slab is closed")
        if min(num_rows, first_row) < 0 or first_row + num_rows > self.capacity_rows:
            raise ValueError(
                f"{num_rows} rows from row {first_row} do not fit a slab of {self.capacity_rows}"
            )
        return rows_view(_buffer(self._shm), self.vocab_size, num_rows, first_row)

    def unlink(self) -> None:
        """Remove the segment's name (the client's, once the server mapped it); mappings stay valid.

        Idempotent.
        """
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()

    def close(self) -> None:
        """Unmap this side's view. Idempotent."""
        if not self.is_closed:
            self.is_closed = True
            address, self.pinned_address = self.pinned_address, None
            try:
                if address is not None:
                    _cuda_call_apart(
                        self._pinned_for, torch.cuda.cudart().cudaHostUnregister, address
                    )
            finally:
                self._shm.close()


def _cuda_call_apart(device: torch.device | None, call, *args) -> int:
    """``call(*args)``'s CUDA status, from a thread of its own whose device is ``device``.

    CUDA keeps a failed call's error as its thread's last error, which torch
    reads after its next kernel launch in that thread and raises there; a
    refused page lock must not fail the server's next request. (The device:
    a new thread's is the first, whose context the call would otherwise create;
    ``cuda`` without an index is this thread's current device.) An exception
    there is raised here.
    """
    index = None
    if device is not None:
        index = torch.cuda.current_device() if device.index is None else device.index
    outcome: list = []

    def run() -> None:
        try:
            if index is not None:
                torch.cuda.set_device(index)
            outcome.append(int(call(*args)))
        except BaseException as error:  # noqa: BLE001  # raised in the caller's thread
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def rows_view(buffer, vocab_size: int, num_rows: int, first_row: int) -> np.ndarray:
    """The ``[num_rows, vocab_size]`` float32 rows of a slab's ``buffer`` from row ``first_row`` on."""
    offset = HEADER_BYTES + 4 * vocab_size * first_row
    flat = np.frombuffer(buffer, np.float32, count=num_rows * vocab_size, offset=offset)
    return flat.reshape(num_rows, vocab_size)


def _buffer(shm: SharedMemory) -> memoryview:
    buffer = shm.buf
    if buffer is None:  # typeshed's type; an open segment always has its buffer
        raise ValueError(f"shared memory {shm.name!r} is closed")
    return buffer


def _reserve_pages(shm: SharedMemory) -> None:
    """Allocate every page now: writing past a full tmpfs raises ``SIGBUS`` in the writer."""
    fd = getattr(shm, "_fd", -1)  # SharedMemory keeps its descriptor here on POSIX
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, shm.size)


def _open_untracked(name: str) -> SharedMemory:
    """Open an existing segment without handing it to this process's resource tracker.

    Before Python 3.13, opening a segment registers it with the opener's
    resource tracker, which would unlink the client's segment (and warn of
    a leak) when the server exits; the client owns it.
    """
    if sys.version_info >= (3, 13):
        return SharedMemory(name, track=False)  # type: ignore[call-arg]  # 3.13+
    shm = SharedMemory(name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm
