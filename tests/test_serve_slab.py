"""Shared-memory slabs (``genlm_backend.llm.remote.slab``): the client's side here, the server's in a process.

The server's side is ``serve_slab_server.py``, which writes seeded rows
(:func:`rows_of`); the reference for every row read back is the same rows
made here. float32 copies are exact: the tolerance is zero.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import pytest
import torch

from genlm_backend.llm.remote.slab import (
    HAS_SEALED,
    NAME_PREFIX,
    SEALED_PREFIX,
    Slab,
    SlabRefused,
    SlabWriter,
    slab_bytes,
)
from tests.serve_slab_server import rows_of
from tests.serve_support import ServerProcess

VOCAB = 1000
SHM = Path("/dev/shm")
SLAB_SERVER = str(Path(__file__).resolve().parent / "serve_slab_server.py")

pytestmark = [
    pytest.mark.skipif(not SHM.is_dir(), reason="POSIX shared memory lives in /dev/shm (Linux)"),
    pytest.mark.timeout(120),
]

KINDS = [
    pytest.param(True, id="sealed", marks=pytest.mark.skipif(not HAS_SEALED, reason="no memfd")),
    pytest.param(False, id="named"),
]
"""Both kinds of slab: a sealed ``memfd`` (the server maps it) and a named segment (the
server writes it through a descriptor)."""


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


@pytest.fixture(params=KINDS)
def mapped(request):
    """A client's slab of 8 rows, of each kind, opened by a server process, its name (if
    any) already unlinked."""
    slab = Slab.create(8, VOCAB, sealed=request.param)
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
    assert slab.segment.startswith(NAME_PREFIX)
    assert slab.name.startswith(SEALED_PREFIX if slab.is_sealed else NAME_PREFIX)
    assert not (SHM / slab.segment).exists()
    tell(server, "write 3 1", "written")  # the memory lives on in both mappings
    assert torch.equal(slab.read(1), rows_of(3, 1, VOCAB))


@pytest.mark.parametrize(
    ("capacity", "nonce", "reason"),
    [(8, bytes(16), "does not hold the offered nonce"), (9, None, "bytes, not the [0-9]+ offered")],
    ids=["another nonce", "too small"],
)
@pytest.mark.parametrize("sealed", KINDS)
def test_the_server_refuses_a_slab_that_is_not_the_one_offered(capacity, nonce, reason, sealed):
    slab = Slab.create(8, VOCAB, sealed)
    server = map_elsewhere(slab, capacity, nonce)
    try:
        server.wait_for(f"^refused: .*{reason}")
    finally:
        server.stop()
        slab.close()
        slab.unlink()


def test_the_server_refuses_a_slab_it_cannot_open():
    """What a server on another machine sees: no segment of that name."""
    slab = Slab.create(2, VOCAB, sealed=False)
    slab.unlink()
    server = map_elsewhere(slab)
    try:
        server.wait_for("^refused: cannot open shared memory")
    finally:
        server.stop()
        slab.close()


@pytest.mark.skipif(not HAS_SEALED, reason="no memfd")
def test_the_server_refuses_a_sealed_slab_it_cannot_open():
    """What a server in another PID namespace sees: no such process or descriptor."""
    slab = Slab.create(2, VOCAB, sealed=True)
    slab.close()  # its descriptor is gone
    server = map_elsewhere(slab)
    try:
        server.wait_for(f"^refused: cannot open '{SEALED_PREFIX}.*' here")
    finally:
        server.stop()


@pytest.mark.skipif(not HAS_SEALED, reason="no memfd")
def test_a_memfd_not_sealed_against_shrinking_is_refused():
    """The seal is what makes a mapping safe: an unsealed segment, however like a slab, is refused."""
    size = slab_bytes(2, VOCAB)
    fd = os.memfd_create(NAME_PREFIX + "unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        os.pwrite(fd, bytes(16), 0)
        with pytest.raises(SlabRefused, match="not sealed against shrinking"):
            SlabWriter.attach(f"{SEALED_PREFIX}{os.getpid()}:{fd}", bytes(16), 2, VOCAB)
    finally:
        os.close(fd)


@pytest.mark.skipif(not HAS_SEALED, reason="no memfd")
def test_a_descriptor_that_is_not_a_slab_is_refused_unopened_or_unkept(tmp_path, monkeypatch):
    """The server reads what a ``memfd:PID:FD`` name points at before opening it, and what it
    opened after (the client may swap its descriptor between)."""
    with open(tmp_path / "file", "w+b") as file:
        name = f"{SEALED_PREFIX}{os.getpid()}:{file.fileno()}"
        with pytest.raises(SlabRefused, match="is not a slab"):
            SlabWriter.attach(name, bytes(16), 2, VOCAB)
        real_readlink = os.readlink
        claims = []

        def lying_once(path):  # the swap: a slab when read, another file when opened
            if not claims:
                claims.append(path)
                return "/memfd:" + NAME_PREFIX + "x (deleted)"
            return real_readlink(path)

        monkeypatch.setattr(os, "readlink", lying_once)
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(SlabRefused, match="is not a slab"):
            SlabWriter.attach(name, bytes(16), 2, VOCAB)
        assert claims and set(os.listdir("/proc/self/fd")) == before  # opened, checked, closed


def test_names_that_are_not_slabs_are_refused_before_opening():
    for name in ("psm_123", NAME_PREFIX + "a/b", NAME_PREFIX + "x" * 60):
        with pytest.raises(SlabRefused, match="not a slab name"):
            SlabWriter.attach(name, bytes(16), 2, VOCAB)
    for name in ("memfd:", "memfd:0:3", "memfd:1:x", "memfd:1:3/../4", "memfd:1:3:4"):
        with pytest.raises(SlabRefused, match="not a sealed slab's name"):
            SlabWriter.attach(name, bytes(16), 2, VOCAB)


@pytest.mark.parametrize("sealed", KINDS)
def test_rows_beyond_the_capacity_are_refused(sealed):
    slab = Slab.create(8, VOCAB, sealed)
    writer = SlabWriter.attach(slab.name, slab.nonce, 8, VOCAB)
    try:
        with pytest.raises(ValueError, match="9 rows from row 0 do not fit a slab of 8"):
            slab.read(9)
        with pytest.raises(ValueError, match="3 rows from row 6 do not fit a slab of 8"):
            slab.read(3, first_row=6)
        with pytest.raises(ValueError, match="9 rows from row 0 do not fit"):
            writer.write(list(torch.zeros(9, VOCAB)))
        with pytest.raises(ValueError, match="2 rows from row 7 do not fit"):
            writer.write(list(torch.zeros(2, VOCAB)), first_row=7)
        with pytest.raises(ValueError, match=f"rows must be float32 \\[{VOCAB}\\]"):
            writer.write([torch.zeros(VOCAB, dtype=torch.float64)])
        with pytest.raises(ValueError, match="rows must be float32"):
            writer.write([torch.zeros(VOCAB + 1)])
        assert torch.equal(slab.read(8), torch.zeros(8, VOCAB))  # nothing was written
    finally:
        writer.close()
        slab.close()
        slab.unlink()


@pytest.mark.parametrize("sealed", KINDS)
def test_rows_are_written_exactly_from_any_row(sealed):
    """Into a mapping of a sealed slab, through a descriptor of a named one."""
    slab = Slab.create(8, VOCAB, sealed)
    writer = SlabWriter.attach(slab.name, slab.nonce, 8, VOCAB)
    try:
        assert writer.is_mapped == sealed
        rows = rows_of(5, 8, VOCAB)
        writer.write(list(rows[:3]), first_row=5)
        writer.write(list(rows[3:5]))
        assert torch.equal(slab.read(3, first_row=5), rows[:3])
        assert torch.equal(slab.read(2), rows[3:5])
        writer.write([rows[7][::1], rows.t().contiguous().t()[6]])  # a strided row is copied too
        assert torch.equal(slab.read(2), torch.stack([rows[7], rows[6]]))
    finally:
        writer.close()
        slab.close()
        slab.unlink()


def test_a_write_of_more_rows_than_one_system_call_takes_is_complete(monkeypatch):
    """``pwritev`` takes at most ``IOV_MAX`` buffers and may write fewer bytes than asked."""
    import genlm_backend.llm.remote.slab as slab_module

    real = os.pwritev
    calls = []

    def short_pwritev(fd, buffers, offset):
        calls.append(len(buffers))
        return real(fd, buffers[:2], offset) - 5 if len(buffers) > 1 else real(fd, buffers, offset)

    monkeypatch.setattr(slab_module, "_IOV_MAX", 3)
    slab = Slab.create(8, VOCAB, sealed=False)
    writer = SlabWriter.attach(slab.name, slab.nonce, 8, VOCAB)
    try:
        rows = rows_of(9, 7, VOCAB)
        with monkeypatch.context() as patch:
            patch.setattr(os, "pwritev", short_pwritev)
            writer.write(list(rows), first_row=1)
        assert max(calls) <= 3 and len(calls) > 3
        assert torch.equal(slab.read(7, first_row=1), rows)
    finally:
        writer.close()
        slab.close()
        slab.unlink()


@pytest.mark.parametrize("sealed", KINDS)
def test_a_full_dev_shm_fails_the_creation_cleanly(monkeypatch, sealed):
    """Pages are reserved at creation, so a full tmpfs fails there (not with SIGBUS in a write)."""
    before = set(os.listdir(SHM))

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    opened = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="No space left"):
        Slab.create(4, VOCAB, sealed)
    if sealed:  # a memfd has no name: its descriptor is all there is to leave behind
        assert set(os.listdir("/proc/self/fd")) == opened
    assert set(os.listdir(SHM)) <= before  # nothing left behind


@pytest.mark.parametrize("sealed", KINDS)
def test_a_closed_slab_refuses_reads_and_writes(sealed):
    slab = Slab.create(1, VOCAB, sealed)
    writer = SlabWriter.attach(slab.name, slab.nonce, 1, VOCAB)
    slab.unlink()
    slab.close()
    slab.close()  # idempotent
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        slab.read(1)
    with pytest.raises(ValueError, match="closed"):
        writer.write(list(torch.zeros(1, VOCAB)))


# A client can do with its own segment what it likes; the server must survive it and
# must not take a segment that is not the client's alone, of exactly the offered size.


@pytest.mark.parametrize("sealed", KINDS)
def test_a_client_that_shrinks_its_slab_cannot_end_the_server(sealed):
    """A mapped segment cut short turns the mapper's next store into SIGBUS. The kernel
    refuses to shrink a sealed slab (the server maps it); the server writes a named one
    through its descriptor, which extends the segment again."""
    slab = Slab.create(8, VOCAB, sealed)
    server = map_elsewhere(slab)
    try:
        server.wait_for("^mapped$")
        slab.unlink()
        with pytest.raises(PermissionError) if sealed else contextlib.nullcontext():
            os.ftruncate(slab.fd, 0)  # the client pulls the segment away
        tell(server, "write 4 8", "written")
        assert server.process.poll() is None  # alive
        assert torch.equal(slab.read(8), rows_of(4, 8, VOCAB))
        with pytest.raises(PermissionError) if sealed else contextlib.nullcontext():
            os.ftruncate(slab.fd, 1)
        tell(server, "write 5 2", "written")
    finally:
        server.stop()
        slab.close()


@pytest.mark.parametrize(
    ("size", "reason", "sealed"),
    [
        (0, "is 0 bytes, not the", False),  # a sealed slab cannot shrink
        (1 << 20, f"is {1 << 20} bytes, not the", False),
        (1 << 20, f"is {1 << 20} bytes, not the", True),
    ],
    ids=["size zero", "grown", "sealed, grown"],
)
def test_a_slab_of_another_size_than_offered_is_refused(size, reason, sealed):
    if sealed and not HAS_SEALED:
        pytest.skip("no memfd")
    slab = Slab.create(2, VOCAB, sealed)
    try:
        os.ftruncate(slab.fd, size)
        with pytest.raises(SlabRefused, match=reason):
            SlabWriter.attach(slab.name, slab.nonce, 2, VOCAB)
    finally:
        slab.close()
        slab.unlink()


@pytest.mark.parametrize("sealed", KINDS)
def test_a_slab_other_users_may_open_is_refused(sealed):
    slab = Slab.create(2, VOCAB, sealed)
    try:
        os.fchmod(slab.fd, 0o644)
        with pytest.raises(SlabRefused, match="open to other users \\(mode 644, expected 600\\)"):
            SlabWriter.attach(slab.name, slab.nonce, 2, VOCAB)
    finally:
        slab.close()
        slab.unlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a segment to another user needs root")
@pytest.mark.parametrize("sealed", KINDS)
def test_a_slab_of_another_user_is_refused(sealed):
    slab = Slab.create(2, VOCAB, sealed)
    try:
        os.fchown(slab.fd, 65534, 65534)  # nobody
        with pytest.raises(SlabRefused, match="belongs to another user"):
            SlabWriter.attach(slab.name, slab.nonce, 2, VOCAB)
    finally:
        slab.close()
        slab.unlink()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sealed", KINDS)
def test_cuda_rows_go_into_the_slab_exactly(sealed):
    """GPU rows go into a sealed slab's mapping, or through the writer's page-locked buffer
    and then the descriptor of a named one."""
    client = Slab.create(8, VOCAB, sealed)
    server = SlabWriter.attach(client.name, client.nonce, 8, VOCAB)
    try:
        rows = rows_of(3, 6, VOCAB)
        server.write(list(rows.cuda()), first_row=2)
        assert torch.equal(client.read(6, first_row=2), rows)
        server.write(list(rows[:2].cuda()))
        assert torch.equal(client.read(2), rows[:2])
    finally:
        server.close()
        client.close()
        client.unlink()


def test_offers_beyond_the_sessions_cap_are_refused():
    from genlm_backend.llm.remote.protocol import SlabOffer
    from genlm_backend.serve.sessions import SlabSessions

    sessions = SlabSessions(VOCAB, max_sessions=1)
    slabs = [Slab.create(2, VOCAB) for _ in range(2)]
    try:
        first = sessions.open(SlabOffer("a", slabs[0].name, slabs[0].nonce, 2))
        with pytest.raises(SlabRefused, match="1 slab sessions at most"):
            sessions.open(SlabOffer("b", slabs[1].name, slabs[1].nonce, 2))
        sessions.close(first)
        sessions.open(SlabOffer("b", slabs[1].name, slabs[1].nonce, 2))  # room again
        assert sessions.num_open == 1
    finally:
        sessions.close_all()
        for slab in slabs:
            slab.close()
            slab.unlink()
