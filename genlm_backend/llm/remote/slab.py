"""Rows through shared memory: a client's slab, which the server writes its answers into.

A slab is one POSIX shared-memory segment (:mod:`multiprocessing.shared_memory`)
that a client creates (:class:`Slab`) and a server on the same machine writes
(:class:`SlabWriter`). Layout::

    [0, HEADER_BYTES)   header: the client's random nonce (NONCE_BYTES), then zeros
    [HEADER_BYTES, ...) rows: float32 [capacity_rows, vocab_size], C order, native byte order

The nonce makes the same-machine check robust: a server accepts a slab only if
it can open the segment by name *and* finds there the nonce the client sent
in its offer, so a name that happens to exist on another machine is refused.

The server never maps a client's segment. A mapping would let the client end
the server: shrinking the segment (``ftruncate`` on its own descriptor) turns
the server's next store into a ``SIGBUS``. The server writes with
``pwritev`` on a descriptor instead, which extends a shrunk segment again or
fails with an error that costs only that client its session. It accepts a
segment only if it belongs to the server's own user, no other user may read
or write it, and its size is exactly the offered slab's.

Lifetime: the client unlinks the segment's name as soon as the server has
opened it (:meth:`Slab.unlink`); from then on the memory is held only by the
client's mapping and the server's descriptor and freed by the kernel when both
are gone, so a killed client or server leaves nothing in ``/dev/shm``. Pages
are reserved at creation (``posix_fallocate``): a full ``/dev/shm`` fails
there, with ``OSError``.

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
import stat
from collections.abc import Sequence
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

HEADER_BYTES = 64
"""Bytes before the first row (the nonce, padded): rows start 64-byte aligned."""
NONCE_BYTES = 16
NAME_PREFIX = "genlm-serve-"
"""Every slab's segment name starts with this (``/dev/shm/genlm-serve-*`` on Linux)."""


class SlabRefused(Exception):
    """A server cannot use the slab a client offered (another machine or user, wrong nonce or
    size), or can no longer write it."""


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
            self._shm.close()


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


class SlabWriter:
    """The server's side of a client's slab: a descriptor it writes rows through, never a mapping.

    Not thread-safe: a server writes and closes it on its event loop.
    """

    def __init__(self, fd: int, capacity_rows: int, vocab_size: int):
        self._fd = fd
        self.capacity_rows = capacity_rows
        self.vocab_size = vocab_size
        self._staging: torch.Tensor | None = None  # page-locked, for rows on a GPU

    @property
    def is_closed(self) -> bool:
        return self._fd < 0

    @classmethod
    def attach(cls, name: str, nonce: bytes, capacity_rows: int, vocab_size: int) -> SlabWriter:
        """Open a client's slab after checking it is the one offered, and the client's alone.

        Raises:
            SlabRefused: the message says why (not a slab name, no such segment here,
                another owner, open to other users, another size, another nonce).
        """
        if not name.startswith(NAME_PREFIX) or "/" in name or len(name) > 64:
            raise SlabRefused(f"not a slab name: {name!r}")
        if min(capacity_rows, vocab_size) < 1:
            raise SlabRefused(f"a slab of {capacity_rows} rows of {vocab_size} holds nothing")
        try:
            fd = _shm_open(name)
        except (
            OSError
        ) as exc:  # FileNotFoundError on another machine, PermissionError for another user
            raise SlabRefused(f"cannot open shared memory {name!r} here ({exc.strerror})") from None
        try:
            _check_private(fd, name, slab_bytes(capacity_rows, vocab_size))
            if os.pread(fd, NONCE_BYTES, 0) != nonce:
                raise SlabRefused(f"shared memory {name!r} does not hold the offered nonce")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, capacity_rows, vocab_size)

    def write(self, rows: Sequence[torch.Tensor], first_row: int = 0) -> None:
        """Copy ``rows`` (float32 ``[vocab_size]`` each, any device) into the slab from row ``first_row`` on.

        Raises:
            ValueError: the rows do not fit, or this writer is closed.
            SlabRefused: the segment cannot be written any more (the client made it
                unwritable, say by shrinking it on a full ``/dev/shm``).
        """
        if self.is_closed:
            raise ValueError("this slab is closed")
        if first_row < 0 or first_row + len(rows) > self.capacity_rows:
            raise ValueError(
                f"{len(rows)} rows from row {first_row} do not fit a slab of {self.capacity_rows}"
            )
        if any(row.dtype != torch.float32 or row.numel() != self.vocab_size for row in rows):
            raise ValueError(f"rows must be float32 [{self.vocab_size}]")
        if all(row.device.type == "cpu" for row in rows):
            buffers = [row.detach().contiguous().numpy().data.cast("B") for row in rows]
        else:
            buffers = [self._to_host(rows).numpy().data.cast("B")]
        try:
            _write_all(self._fd, buffers, HEADER_BYTES + 4 * self.vocab_size * first_row)
        except OSError as exc:
            raise SlabRefused(f"the slab cannot be written ({exc.strerror})") from None

    def _to_host(self, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """GPU rows in this writer's page-locked buffer (the copy engine writes it directly)."""
        if self._staging is None:
            try:
                self._staging = torch.empty(self.capacity_rows, self.vocab_size, pin_memory=True)
            except RuntimeError:  # no more lockable memory: pageable then
                self._staging = torch.empty(self.capacity_rows, self.vocab_size)
        staged = self._staging[: len(rows)]
        staged.copy_(torch.stack(list(rows)))
        return staged

    def close(self) -> None:
        """Close the descriptor. Idempotent."""
        fd, self._fd = self._fd, -1
        self._staging = None
        if fd >= 0:
            os.close(fd)


def _check_private(fd: int, name: str, size: int) -> None:
    """Refuse a segment that is not a plain file of exactly ``size`` bytes that the server's
    user owns and no other user may read or write."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise SlabRefused(f"shared memory {name!r} is not a plain segment")
    if info.st_uid != os.geteuid():
        raise SlabRefused(f"shared memory {name!r} belongs to another user")
    if info.st_mode & 0o077:
        raise SlabRefused(
            f"shared memory {name!r} is open to other users (mode {stat.S_IMODE(info.st_mode):o}, "
            "expected 600)"
        )
    if info.st_size != size:
        raise SlabRefused(f"shared memory {name!r} is {info.st_size} bytes, not the {size} offered")


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _write_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """``pwritev`` every byte of ``buffers`` at ``offset``, over short writes and ``IOV_MAX``."""
    pending = [buffer for buffer in buffers if len(buffer)]
    while pending:
        written = os.pwritev(fd, pending[:_IOV_MAX], offset)
        if written <= 0:
            raise OSError(0, "nothing written")
        offset += written
        while pending and written >= len(pending[0]):
            written -= len(pending.pop(0))
        if written:
            pending[0] = pending[0][written:]


def _shm_open(name: str) -> int:
    """A read-write descriptor of the existing POSIX segment ``name`` (not handed to any tracker)."""
    import _posixshmem  # the module SharedMemory opens segments with

    return _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
