"""Rows through shared memory: a client's slab, which the server writes its answers into.

A slab is one segment of memory that a client creates (:class:`Slab`) and a
server on the same machine writes (:class:`SlabWriter`). Layout::

    [0, HEADER_BYTES)   header: the client's random nonce (NONCE_BYTES), then zeros
    [HEADER_BYTES, ...) rows: float32 [capacity_rows, vocab_size], C order, native byte order

The nonce makes the same-machine check robust: a server accepts a slab only if
it can open the segment *and* finds there the nonce the client sent in its
offer, so a name that happens to exist elsewhere is refused. It accepts a
segment only if it belongs to the server's own user, no other user may read
or write it, and its size is exactly the offered slab's.

Two kinds of segment, one layout:

* **Sealed** (Linux, the default there): a ``memfd`` the client seals against
  shrinking (``F_SEAL_SHRINK``), named ``memfd:PID:FD`` in its offer; the
  server opens it through ``/proc/PID/fd/FD`` (possible only for a process
  of its own user that it can see), checks the seal, and **maps** it: a
  batch's rows are copied straight into the client's pages. A mapping of a
  segment that can shrink would let the client end the server (``ftruncate``
  turns the server's next store into a ``SIGBUS``); the kernel refuses to
  shrink a sealed one, so a mapping of it is safe.
* **Named**: a POSIX shared-memory segment (:mod:`multiprocessing.shared_memory`),
  for servers that cannot open the client's descriptors (another PID
  namespace) and systems without ``memfd``. Such a segment can shrink, so
  the server never maps it: it writes with ``pwritev`` on a descriptor, which
  extends a shrunk segment again or fails with an error that costs only that
  client its session.

Lifetime: the client unlinks a named segment as soon as the server has
opened it (:meth:`Slab.unlink`; a sealed one never had a name); from then on
the memory is held only by the two processes and freed by the kernel when
both are gone, so a killed client or server leaves nothing in ``/dev/shm``.
Pages are reserved at creation (``posix_fallocate``): too little shared
memory fails there, with ``OSError``.

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
import re
import secrets
import stat
from collections.abc import Sequence
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

try:
    import fcntl
except ImportError:  # Windows: named slabs only
    fcntl = None  # type: ignore[assignment]

HEADER_BYTES = 64
"""Bytes before the first row (the nonce, padded): rows start 64-byte aligned."""
NONCE_BYTES = 16
NAME_PREFIX = "genlm-serve-"
"""Every named slab's segment name starts with this (``/dev/shm/genlm-serve-*`` on Linux)."""
SEALED_PREFIX = "memfd:"
"""A sealed slab's name in an offer: ``memfd:PID:FD``."""
HAS_SEALED = (
    hasattr(os, "memfd_create")
    and fcntl is not None
    and hasattr(fcntl, "F_ADD_SEALS")
    and os.path.isdir("/proc/self/fd")
)
"""Whether this system makes sealed slabs (Linux)."""

_SEALED_NAME = re.compile(r"memfd:([1-9][0-9]{0,9}):([0-9]{1,9})")
_SEALED_TARGET = "/memfd:" + NAME_PREFIX  # what /proc/PID/fd/FD reads for a sealed slab


class SlabRefused(Exception):
    """A server cannot use the slab a client offered (another machine or user, wrong nonce or
    size), or can no longer write it."""


def slab_bytes(capacity_rows: int, vocab_size: int) -> int:
    """Size of a slab holding ``capacity_rows`` rows of ``vocab_size`` float32."""
    return HEADER_BYTES + 4 * capacity_rows * vocab_size


class Slab:
    """One segment of rows, as a client created it.

    Not thread-safe: a client reads and closes it under its ``AsyncLM``'s
    compute lock.
    """

    def __init__(
        self,
        name: str,
        segment: str,
        fd: int,
        mapping: mmap.mmap,
        capacity_rows: int,
        vocab_size: int,
        nonce: bytes,
        shm: SharedMemory | None = None,
    ):
        self.name = name
        """What the client offers: a named segment's name, or ``memfd:PID:FD``."""
        self.segment = segment
        """The segment's own name, as ``/proc/PID/maps`` shows it (``/dev/shm/NAME`` or
        ``/memfd:NAME``)."""
        self.fd = fd
        """The segment's descriptor (the client's own)."""
        self._mapping = mapping
        self._shm = shm  # a named segment's owner (it holds ``fd`` and ``mapping``)
        self.capacity_rows = capacity_rows
        self.vocab_size = vocab_size
        self.nonce = nonce
        self.is_closed = False

    @property
    def is_sealed(self) -> bool:
        """Whether the segment cannot shrink (a sealed ``memfd``), so the server may map it."""
        return self._shm is None

    @classmethod
    def create(cls, capacity_rows: int, vocab_size: int, sealed: bool | None = None) -> Slab:
        """A new slab (the client's), its pages reserved and its nonce written.

        Args:
            sealed: A sealed segment (the default where :data:`HAS_SEALED`) or a named one.

        Raises:
            OSError: no shared memory here, or not enough of it (e.g. a small ``/dev/shm``).
        """
        size = slab_bytes(capacity_rows, vocab_size)
        nonce = secrets.token_bytes(NONCE_BYTES)
        name = NAME_PREFIX + secrets.token_hex(12)
        if sealed is None:
            sealed = HAS_SEALED
        if sealed:
            fd, mapping = _sealed_segment(name, size)
            mapping[:NONCE_BYTES] = nonce
            offered = f"{SEALED_PREFIX}{os.getpid()}:{fd}"
            return cls(offered, name, fd, mapping, capacity_rows, vocab_size, nonce)
        shm = SharedMemory(name=name, create=True, size=size)
        fd = getattr(shm, "_fd", -1)  # SharedMemory's descriptor on POSIX
        try:
            if fd >= 0:
                _reserve_pages(fd, size)
            _buffer(shm)[:NONCE_BYTES] = nonce
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        mapping = shm._mmap  # type: ignore[attr-defined]  # closed by shm.close()
        return cls(shm.name, shm.name, fd, mapping, capacity_rows, vocab_size, nonce, shm)

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
        return mmap.mmap(self.fd, len(self._mapping))  # mmap keeps a descriptor of its own

    def _view(self, num_rows: int, first_row: int = 0) -> np.ndarray:
        if self.is_closed:
            raise ValueError("this slab is closed")
        if min(num_rows, first_row) < 0 or first_row + num_rows > self.capacity_rows:
            raise ValueError(
                f"{num_rows} rows from row {first_row} do not fit a slab of {self.capacity_rows}"
            )
        return rows_view(self._mapping, self.vocab_size, num_rows, first_row)

    def unlink(self) -> None:
        """Remove a named segment's name (once the server opened it); mappings stay valid.

        Idempotent; nothing to do for a sealed segment, which has no name.
        """
        if self._shm is not None:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()

    def close(self) -> None:
        """Unmap this side's view and close its descriptor. Idempotent."""
        if self.is_closed:
            return
        self.is_closed = True
        if self._shm is not None:
            self._shm.close()
        else:
            self._mapping.close()
            os.close(self.fd)


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


def _reserve_pages(fd: int, size: int) -> None:
    """Allocate every page now: writing past a full tmpfs raises ``SIGBUS`` in the writer."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)


def _sealed_segment(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A new ``memfd`` of ``size`` bytes, private, its pages reserved, sealed against
    shrinking; its descriptor and a mapping."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        _reserve_pages(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


class SlabWriter:
    """The server's side of a client's slab: a mapping of a sealed one, a descriptor of a
    named one (which it never maps).

    Not thread-safe: a server writes and closes it on its event loop.
    """

    def __init__(
        self, capacity_rows: int, vocab_size: int, fd: int = -1, mapping: mmap.mmap | None = None
    ):
        self._fd = fd
        self._mapping = mapping
        self.capacity_rows = capacity_rows
        self.vocab_size = vocab_size
        self._staging: torch.Tensor | None = None  # page-locked, for rows on a GPU

    @property
    def is_closed(self) -> bool:
        return self._fd < 0 and self._mapping is None

    @property
    def is_mapped(self) -> bool:
        """Whether rows are copied into a mapping (a sealed slab), not written through a descriptor."""
        return self._mapping is not None

    @classmethod
    def attach(cls, name: str, nonce: bytes, capacity_rows: int, vocab_size: int) -> SlabWriter:
        """Open a client's slab after checking it is the one offered, and the client's alone.

        Raises:
            SlabRefused: the message says why (not a slab name, no such segment here,
                another owner, open to other users, another size, another nonce, not
                sealed against shrinking).
        """
        sealed = name.startswith(SEALED_PREFIX)
        if sealed:
            if not (HAS_SEALED and _SEALED_NAME.fullmatch(name)):
                raise SlabRefused(f"not a sealed slab's name here: {name!r}")
        elif not name.startswith(NAME_PREFIX) or "/" in name or len(name) > 64:
            raise SlabRefused(f"not a slab name: {name!r}")
        if min(capacity_rows, vocab_size) < 1:
            raise SlabRefused(f"a slab of {capacity_rows} rows of {vocab_size} holds nothing")
        size = slab_bytes(capacity_rows, vocab_size)
        fd = _open_sealed(name) if sealed else _open_named(name)
        try:
            _check_private(fd, name, size)
            if sealed and not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise SlabRefused(f"{name!r} is not sealed against shrinking")
            if os.pread(fd, NONCE_BYTES, 0) != nonce:
                raise SlabRefused(f"shared memory {name!r} does not hold the offered nonce")
            if not sealed:
                return cls(capacity_rows, vocab_size, fd=fd)
            try:
                mapping = mmap.mmap(fd, size)
            except OSError as exc:  # sealed against writing
                raise SlabRefused(f"cannot map {name!r} for writing ({exc.strerror})") from None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the mapping keeps the memory
        return cls(capacity_rows, vocab_size, mapping=mapping)

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
        if not rows:
            return
        on_cpu = all(row.device.type == "cpu" for row in rows)
        if self._mapping is not None:
            target = rows_view(self._mapping, self.vocab_size, len(rows), first_row)
            if on_cpu:
                # numpy's copy, on this thread: a copy split over torch's threads waits
                # for a core whenever another process holds one (4x slower beside its client).
                np.stack([row.detach().view(-1).numpy() for row in rows], out=target)
            else:
                torch.from_numpy(target).copy_(torch.stack([row.detach().view(-1) for row in rows]))
            return
        if on_cpu:
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
        """Unmap the slab or close the descriptor. Idempotent."""
        fd, self._fd = self._fd, -1
        mapping, self._mapping = self._mapping, None
        self._staging = None
        if fd >= 0:
            os.close(fd)
        if mapping is not None:
            mapping.close()


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


def _open_named(name: str) -> int:
    """A read-write descriptor of the existing POSIX segment ``name`` (not handed to any tracker)."""
    import _posixshmem  # the module SharedMemory opens segments with

    try:
        return _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except OSError as exc:  # FileNotFoundError on another machine, PermissionError for another user
        raise SlabRefused(f"cannot open shared memory {name!r} here ({exc.strerror})") from None


def _open_sealed(name: str) -> int:
    """A read-write descriptor of the ``memfd`` that ``memfd:PID:FD`` names, through ``/proc``.

    The path is read before it is opened (only a sealed slab's is) and the
    descriptor after (the client may have replaced its descriptor between):
    nothing but a ``memfd`` of a slab is opened or kept.
    """
    pid, fd = _SEALED_NAME.fullmatch(name).groups()  # type: ignore[union-attr]  # checked
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(_SEALED_TARGET):
            raise SlabRefused(f"{name!r} is not a slab")
        opened = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:  # another PID namespace, another user, a process gone
        raise SlabRefused(f"cannot open {name!r} here ({exc.strerror})") from None
    try:
        if not os.readlink(f"/proc/self/fd/{opened}").startswith(_SEALED_TARGET):
            raise SlabRefused(f"{name!r} is not a slab")
    except BaseException:
        os.close(opened)
        raise
    return opened
