"""Shared-memory slabs (``genlm_backend.llm.remote.slab``): the client's side here, the server's in a process.

The server's side is ``serve_slab_server.py``, which writes seeded rows
(:func:`rows_of`); the reference for every row read back is the same rows
made here. float32 copies are exact: the tolerance is zero.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from genlm_backend.llm.remote.slab import NAME_PREFIX, Slab
from tests.serve_slab_server import rows_of
from tests.serve_support import ServerProcess

VOCAB = 1000
SHM = Path("/dev/shm")
SLAB_SERVER = str(Path(__file__).resolve().parent / "serve_slab_server.py")

pytestmark = [
    pytest.mark.skipif(not SHM.is_dir(), reason="POSIX shared memory lives in /dev/shm (Linux)"),
    pytest.mark.timeout(120),
]


def map_elsewhere(slab: Slab, capacity: int | None = None, nonce: bytes | None = None):
    """The server's side of ``slab``, in a process of its own; ``capacity``/``nonce`` as offered."""
    offered = slab.nonce if nonce is None else nonce
    capacity = slab.capacity_rows if capacity is None else capacity
    return ServerProcess([SLAB_SERVER, slab.name, offered.hex(), str(capacity), str(VOCAB)])


def tell(server: ServerProcess, command: str, answer: str) -> None:
    server.process.stdin.write(command + "\n")  # type: ignore[union-attr]
    server.process.stdin.flush()  # type: ignore[union-attr]
    server.lines.clear()  # wait for this command's answer, not an earlier one
    server.wait_for(f"^{answer}$")


@pytest.fixture
def mapped():
    """A client's slab of 8 rows, mapped by a server process, its name already unlinked."""
    slab = Slab.create(8, VOCAB)
    server = map_elsewhere(slab)
    try:
        server.wait_for("^mapped$")
        slab.unlink()
        yield slab, server
    finally:
        server.stop()
        slab.close()
        slab.unlink()


def test_rows_written_by_the_server_are_read_exactly(mapped):
    slab, server = mapped
    tell(server, "write 1 5", "written")
    rows = slab.read(5)
    assert rows.dtype == torch.float32 and rows.shape == (5, VOCAB)
    assert torch.equal(rows, rows_of(1, 5, VOCAB))


def test_rows_read_stay_valid_and_unaliased_when_the_slab_is_reused(mapped):
    slab, server = mapped
    tell(server, "write 1 8", "written")
    first = slab.read(8)
    tell(server, "write 2 3", "written")
    second = slab.read(3)
    assert torch.equal(first, rows_of(1, 8, VOCAB))
    assert torch.equal(second, rows_of(2, 3, VOCAB))
    first.fill_(0.0)  # the caller's own tensor: the slab does not change
    assert torch.equal(slab.read(3), rows_of(2, 3, VOCAB))


def test_once_mapped_and_unlinked_nothing_is_left_in_dev_shm(mapped):
    slab, server = mapped
    assert slab.name.startswith(NAME_PREFIX)
    assert not (SHM / slab.name).exists()
    tell(server, "write 3 1", "written")  # the memory lives on in both mappings
    assert torch.equal(slab.read(1), rows_of(3, 1, VOCAB))


@pytest.mark.parametrize(
    ("capacity", "nonce", "reason"),
    [(8, bytes(16), "does not hold the offered nonce"), (9, None, "smaller than 9 rows")],
    ids=["another nonce", "too small"],
)
def test_the_server_refuses_a_slab_that_is_not_the_one_offered(capacity, nonce, reason):
    slab = Slab.create(8, VOCAB)
    server = map_elsewhere(slab, capacity, nonce)
    try:
        server.wait_for(f"^refused: .*{reason}")
    finally:
        server.stop()
        slab.close()
        slab.unlink()


def test_the_server_refuses_a_slab_it_cannot_open():
    """What a server on another machine sees: no segment of that name."""
    slab = Slab.create(2, VOCAB)
    slab.unlink()
    server = map_elsewhere(slab)
    try:
        server.wait_for("^refused: cannot open shared memory")
    finally:
        server.stop()
        slab.close()


def test_names_that_are_not_slabs_are_refused_before_opening():
    from genlm_backend.llm.remote.slab import SlabRefused

    for name in ("psm_123", NAME_PREFIX + "a/b", NAME_PREFIX + "x" * 60):
        with pytest.raises(SlabRefused, match="not a slab name"):
            Slab.attach(name, bytes(16), 2, VOCAB)


def test_rows_beyond_the_capacity_are_refused():
    slab = Slab.create(8, VOCAB)
    try:
        with pytest.raises(ValueError, match="9 rows from row 0 do not fit a slab of 8"):
            slab.read(9)
        with pytest.raises(ValueError, match="3 rows from row 6 do not fit a slab of 8"):
            slab.read(3, first_row=6)
        with pytest.raises(ValueError, match="9 rows from row 0 do not fit"):
            slab.write(torch.zeros(9, VOCAB))
        with pytest.raises(ValueError, match="2 rows from row 7 do not fit"):
            slab.write(torch.zeros(2, VOCAB), first_row=7)
    finally:
        slab.close()
        slab.unlink()


def test_a_full_dev_shm_fails_the_creation_cleanly(monkeypatch):
    """Pages are reserved at creation, so a full tmpfs fails there (not with SIGBUS in a write)."""
    before = set(os.listdir(SHM))

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match="No space left"):
        Slab.create(4, VOCAB)
    assert set(os.listdir(SHM)) <= before  # nothing left behind


def test_a_closed_slab_refuses_reads_and_writes():
    slab = Slab.create(1, VOCAB)
    slab.unlink()
    slab.close()
    slab.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        slab.read(1)
    with pytest.raises(ValueError, match="closed"):
        slab.write(torch.zeros(1, VOCAB))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_go_into_a_page_locked_slab_exactly():
    """The server's side page-locks its mapping before its first CUDA rows, and unlocks it on close."""
    client = Slab.create(8, VOCAB)
    server = Slab.attach(client.name, client.nonce, 8, VOCAB)
    try:
        rows = rows_of(3, 6, VOCAB)
        server.write(list(rows.cuda()), first_row=2)
        assert server.pinned_address is not None
        assert torch.equal(client.read(6, first_row=2), rows)
        server.write(list(rows[:2].cuda()))  # locked once, still exact
        assert torch.equal(client.read(2), rows[:2])
    finally:
        server.close()
        assert server.pinned_address is None
        client.close()
        client.unlink()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_refused_page_lock_leaves_no_cuda_error_in_the_server_s_thread():
    """CUDA keeps a failed call's error for its thread's next kernel launch: the call runs apart."""
    import numpy as np

    from genlm_backend.llm.remote.slab import _cuda_call_apart

    memory = np.zeros(1 << 16, np.uint8)
    unregister = torch.cuda.cudart().cudaHostUnregister
    assert (
        _cuda_call_apart(torch.device("cuda"), unregister, memory.ctypes.data) != 0
    )  # never locked
    assert torch.ones(8, device="cuda").add_(1).sum().item() == 16  # launches without that error


def test_a_call_apart_raises_its_exception_in_the_caller_s_thread():
    from genlm_backend.llm.remote.slab import _cuda_call_apart

    def refuse(code):
        raise OSError(code, "refused")

    with pytest.raises(OSError, match="refused"):
        _cuda_call_apart(None, refuse, 7)
    assert _cuda_call_apart(None, lambda a, b: a + b, 2, 3) == 5


def test_a_failed_unlock_still_unmaps_the_slab(monkeypatch):
    """Closing a page-locked mapping whose unlock fails unmaps it all the same, and says why."""
    import genlm_backend.llm.remote.slab as slab_module

    def fail(*args):
        raise RuntimeError("no CUDA here")

    from multiprocessing import resource_tracker

    client = Slab.create(2, VOCAB)
    server = Slab.attach(client.name, client.nonce, 2, VOCAB)
    # Attaching in the creator's process took the segment from this process's tracker
    # (a server's process is another); the client's unlink below gives it back.
    resource_tracker.register(client._shm._name, "shared_memory")
    try:
        server.pinned_address = 1  # as if locked
        monkeypatch.setattr(slab_module, "_cuda_call_apart", fail)
        monkeypatch.setattr(
            torch.cuda, "cudart", lambda: type("Cudart", (), {"cudaHostUnregister": None})
        )
        with pytest.raises(RuntimeError, match="no CUDA here"):
            server.close()
        assert server.is_closed and server.pinned_address is None
        assert server._shm.buf is None  # unmapped
    finally:
        client.close()
        client.unlink()
