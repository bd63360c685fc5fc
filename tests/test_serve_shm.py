"""Rows through shared memory between a ``RemoteLM`` and a server process on this machine.

The server is ``serve_gated_server.py`` (a mock model over 256 byte tokens,
ungated); the reference is an in-process ``MockAsyncLM`` over the same
vocabulary, and every row must be the same float32 bytes. What is left
behind is read from the system itself: ``/dev/shm`` (names) and each
process's ``/proc/PID/maps`` (mappings, which hold the memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import signal
from pathlib import Path

import pytest
import torch

from genlm_backend import MockAsyncLM
from genlm_backend.errors import RemoteModelError, ServerUnavailableError
from genlm_backend.llm.remote import client_slab
from genlm_backend.llm.remote.slab import HAS_SEALED, SEALED_PREFIX, Slab, slab_bytes
from genlm_backend.serve import RemoteLM
from tests.serve_gated_server import BYTE_VOCAB
from tests.serve_support import ServerProcess, wait_until

SHM = Path("/dev/shm")

pytestmark = [
    pytest.mark.skipif(
        not (SHM.is_dir() and Path("/proc/self/maps").exists()),
        reason="reads /dev/shm and /proc/PID/maps (Linux)",
    ),
    pytest.mark.timeout(120),
]


def maps_of(pid: int | str) -> str:
    """Every mapping of process ``pid``, as the kernel lists them."""
    return Path(f"/proc/{pid}/maps").read_text()


def held_by(pid: int) -> str:
    """What process ``pid`` maps or holds open: a server writes slabs through descriptors."""
    opened = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            opened.append(os.readlink(fd))
    return maps_of(pid) + "\n".join(opened)


def contexts(first: int, count: int) -> list[list[int]]:
    return [[first, token] for token in range(count)]


@pytest.fixture(scope="module")
def reference():
    return MockAsyncLM(byte_vocab=BYTE_VOCAB)


@pytest.fixture(scope="module")
def server():
    server = ServerProcess.gated()
    yield server
    server.stop()


@pytest.fixture(
    params=[
        pytest.param(
            True, id="sealed", marks=pytest.mark.skipif(not HAS_SEALED, reason="no memfd")
        ),
        pytest.param(False, id="named"),
    ]
)
def remote(server, request, monkeypatch):
    """A client of ``server`` whose slab is a sealed ``memfd`` (the server maps it) or a
    named segment (the server writes it through a descriptor)."""
    monkeypatch.setattr(client_slab, "HAS_SEALED", request.param)
    with RemoteLM(server.url) as lm:
        yield lm


def test_a_client_on_the_servers_machine_gets_exact_rows_through_shared_memory(
    remote, reference, server
):
    _, before = remote.server_stats()
    rows = remote.batch_next_token_logprobs_sync(contexts(1, 16))
    assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts(1, 16)))
    name = remote.runner.slab_name
    assert name is not None and remote.runner.shared_memory_refusal is None
    assert not (SHM / name).exists()  # unlinked as soon as the server opened it
    assert name in held_by(server.process.pid) and name in maps_of("self")
    _, after = remote.server_stats()
    assert after.num_rows_in_shared_memory - before.num_rows_in_shared_memory == 16


def test_a_client_that_shrinks_its_slab_cannot_end_the_server(remote, reference, server):
    """A mapping's store into a segment cut short would end the server (SIGBUS): the kernel
    refuses to shrink a sealed slab, which the server maps; a named segment, which it
    writes through a descriptor, is extended again by the write."""
    remote.batch_next_token_logprobs_sync(contexts(4, 4))
    slab = remote.runner._slab.slab  # type: ignore[union-attr]
    with pytest.raises(PermissionError) if slab.is_sealed else contextlib.nullcontext():
        os.ftruncate(slab.fd, 0)
    rows = remote.batch_next_token_logprobs_sync(contexts(5, 4))
    assert server.process.poll() is None
    assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts(5, 4)))
    with RemoteLM(server.url) as other:  # the server serves the next client as before
        assert torch.equal(
            other.batch_next_token_logprobs_sync(contexts(6, 4)),
            reference.batch_next_token_logprobs_sync(contexts(6, 4)),
        )


async def test_returned_rows_stay_valid_and_unaliased_when_the_slab_is_reused(remote, reference):
    first = await remote.batch_next_token_logprobs(contexts(2, 8))
    single = await remote.next_token_logprobs([2, 99])
    second = await remote.batch_next_token_logprobs(contexts(3, 8))  # the same slab, rewritten
    assert torch.equal(first, reference.batch_next_token_logprobs_sync(contexts(2, 8)))
    assert torch.equal(single, reference.next_token_logprobs_sync([2, 99]))
    first.fill_(0.0)
    assert torch.equal(second, reference.batch_next_token_logprobs_sync(contexts(3, 8)))
    remote.clear_cache()  # the client's own cache off the path: the rows come from the slab again
    assert torch.equal(
        await remote.batch_next_token_logprobs(contexts(2, 8)),
        reference.batch_next_token_logprobs_sync(contexts(2, 8)),
    )


async def test_batch_rows_are_lent_without_a_copy_until_their_tensors_go(server, reference):
    def expected(first: int) -> torch.Tensor:
        return reference.batch_next_token_logprobs_sync(contexts(first, 8))

    with RemoteLM(server.url, output_cache_bytes=0) as lm:
        first = await lm.batch_next_token_logprobs(contexts(6, 8))
        second = await lm.batch_next_token_logprobs(contexts(7, 8))
        assert (lm.runner.num_rows_lent, lm.runner.num_rows_on_loan) == (16, 16)
        # Both lent regions are held: the next batch goes through the scratch rows, copied.
        third = await lm.batch_next_token_logprobs(contexts(8, 8))
        assert (lm.runner.num_rows_lent, lm.runner.num_rows_on_loan) == (16, 16)
        for rows, first_token in ((first, 6), (second, 7), (third, 8)):
            assert torch.equal(rows, expected(first_token))
        second.fill_(0.0)  # the caller's own: the server's rows do not change
        assert torch.equal(await lm.batch_next_token_logprobs(contexts(7, 8)), expected(7))
        del first, second, third
        wait_until(lambda: nothing_on_loan(lm))
        # A single-row call's row is a view of its batch's region too: the region comes back
        # once that row is gone (and the loop and the worker have let go of the batch: the
        # call's future holds the row until the loop's turn that handed it ends).
        single = await lm.next_token_logprobs([9, 1])
        assert torch.equal(single, reference.next_token_logprobs_sync([9, 1]))
        assert (lm.runner.num_rows_lent, lm.runner.num_rows_on_loan) == (17, 1)
        del single
        await asyncio.sleep(0)  # the turn that handed the row ends
        wait_until(lambda: nothing_on_loan(lm))


def nothing_on_loan(lm: RemoteLM) -> bool:
    gc.collect()
    return lm.runner.num_rows_on_loan == 0


def test_a_batch_the_server_fails_gives_its_region_back(server):
    with RemoteLM(server.url, output_cache_bytes=0) as lm:
        lm.batch_next_token_logprobs_sync(contexts(12, 2))  # opens the slab
        wait_until(lambda: nothing_on_loan(lm))
        with pytest.raises(RemoteModelError, match="the model failed this batch"):
            lm.batch_next_token_logprobs_sync([[12, 255], [12, 3]])  # token 255 fails it
        assert lm.runner.slab_name is not None  # an answer came: the slab stays
        assert lm.runner.num_rows_on_loan == 0


def test_lent_rows_outlive_their_client_and_then_free_the_slab(server, reference):
    lm = RemoteLM(server.url, output_cache_bytes=0)
    rows = lm.batch_next_token_logprobs_sync(contexts(10, 4))
    name = lm.runner.slab_name
    assert lm.runner.num_rows_on_loan == 4
    lm.close()
    wait_until(lambda: name not in held_by(server.process.pid))
    assert name in maps_of("self")  # the lent rows' mapping
    assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts(10, 4)))
    del rows
    gc.collect()
    wait_until(lambda: name not in maps_of("self"))


def test_a_dev_shm_without_room_for_three_batches_gets_a_slab_of_scratch_rows(
    server, reference, monkeypatch
):
    reserve, one_batch = os.posix_fallocate, slab_bytes(8, len(BYTE_VOCAB))

    def small_dev_shm(fd: int, offset: int, length: int) -> None:
        if length > one_batch:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        reserve(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", small_dev_shm)
    with RemoteLM(server.url, output_cache_bytes=0) as lm:
        rows = lm.batch_next_token_logprobs_sync(contexts(11, 8))
        assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts(11, 8)))
        assert lm.runner.slab_name is not None and lm.runner.shared_memory_refusal is None
        assert lm.runner.num_rows_lent == 0  # copied out of the scratch rows


def test_the_slab_grows_with_the_batches_and_each_client_holds_one(server):
    with RemoteLM(server.url) as lm:
        lm.next_token_logprobs_sync([4, 1])
        small = lm.runner.slab_name
        lm.batch_next_token_logprobs_sync(contexts(4, 40))  # needs a slab of 64 rows
        large = lm.runner.slab_name
        assert large not in (None, small)
        assert small not in maps_of("self")
        wait_until(lambda: small not in held_by(server.process.pid))
        assert large in held_by(server.process.pid)
    assert lm.runner.slab_name is None and large not in maps_of("self")
    wait_until(lambda: large not in held_by(server.process.pid))


def test_without_shared_memory_rows_come_in_answer_bodies(server, reference):
    with RemoteLM(server.url, shared_memory=False) as lm:
        _, before = lm.server_stats()
        rows = lm.batch_next_token_logprobs_sync(contexts(5, 4))
        assert lm.runner.slab_name is None
        assert lm.runner.shared_memory_refusal == "shared_memory=False"
        _, after = lm.server_stats()
    assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts(5, 4)))
    assert after.num_rows_in_shared_memory == before.num_rows_in_shared_memory


def test_a_server_that_cannot_open_the_slab_answers_in_bodies(server, reference, monkeypatch):
    """What a client of a server on another machine sees: the slab's name is not there."""
    create = Slab.create

    def elsewhere(capacity_rows: int, vocab_size: int, sealed: bool | None = None) -> Slab:
        slab = create(capacity_rows, vocab_size, sealed)
        if slab.is_sealed:  # a process the server cannot see
            slab.name = f"{SEALED_PREFIX}{2**31 - 1}:{slab.fd}"
        slab.unlink()
        return slab

    monkeypatch.setattr(Slab, "create", elsewhere)
    with RemoteLM(server.url) as lm:
        rows = lm.batch_next_token_logprobs_sync(contexts(6, 4))
        assert lm.runner.slab_name is None
        assert "cannot open shared memory" in str(lm.runner.shared_memory_refusal)
        round_trips = lm.runner.num_round_trips
        lm.batch_next_token_logprobs_sync(contexts(7, 4))  # no new offer: one round trip
        assert lm.runner.num_round_trips == round_trips + 1
    assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts(6, 4)))


@pytest.mark.skipif(not HAS_SEALED, reason="no memfd")
def test_a_server_that_cannot_open_a_sealed_slab_gets_a_named_one(server, reference, monkeypatch):
    """A server in another PID namespace cannot open the client's descriptors, but may share
    its /dev/shm: the client offers a named segment next."""
    create = Slab.create

    def unseen(capacity_rows: int, vocab_size: int, sealed: bool | None = None) -> Slab:
        slab = create(capacity_rows, vocab_size, sealed)
        if slab.is_sealed:
            slab.name = f"{SEALED_PREFIX}{2**31 - 1}:{slab.fd}"
        return slab

    monkeypatch.setattr(Slab, "create", unseen)
    with RemoteLM(server.url, output_cache_bytes=0) as lm:
        rows = lm.batch_next_token_logprobs_sync(contexts(6, 4))
        assert lm.runner.shared_memory_refusal is None
        assert not lm.runner._slab.slab.is_sealed  # type: ignore[union-attr]
        assert f"/dev/shm/{lm.runner.slab_name}" in held_by(server.process.pid)
        assert lm.runner.num_channel_round_trips == 1
    assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts(6, 4)))


CLIENT = (
    "import sys; from genlm_backend.serve import RemoteLM\n"
    "lm = RemoteLM(sys.argv[1])\n"
    "lm.batch_next_token_logprobs_sync([[8, t] for t in range(4)])\n"
    "print('slab', lm.runner.slab_name, flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_killed_client_leaves_nothing_behind(server):
    client = ServerProcess(["-c", CLIENT, server.url])
    try:
        name = client.wait_for(r"^slab (\S+)$").group(1)
        assert not (SHM / name).exists()
        assert name in held_by(server.process.pid)
        client.process.kill()
        client.wait_exit()
        # The server sees the session's connection go and closes it: the kernel frees the memory.
        wait_until(lambda: name not in held_by(server.process.pid))
        assert not (SHM / name).exists()
    finally:
        client.stop()


def test_a_client_killed_before_its_slab_was_mapped_leaves_nothing_behind():
    """Between creating its slab and the server's mapping, a client's resource tracker owns it."""
    script = (
        "import sys; from genlm_backend.llm.remote.slab import Slab\n"
        "slab = Slab.create(4, 256, sealed=False); print('slab', slab.name, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    client = ServerProcess(["-c", script])
    try:
        name = client.wait_for(r"^slab (\S+)$").group(1)
        assert (SHM / name).exists()
        client.process.kill()
        client.wait_exit()
        wait_until(lambda: not (SHM / name).exists())
    finally:
        client.stop()


def test_a_killed_server_leaves_nothing_behind_and_its_client_carries_on(reference):
    server = ServerProcess.gated()
    client = RemoteLM(server.url)
    try:
        client.batch_next_token_logprobs_sync(contexts(9, 4))
        name = client.runner.slab_name
        assert name is not None and name in held_by(server.process.pid)
        server.process.kill()
        server.wait_exit()
        assert not (SHM / name).exists()
        with pytest.raises(ServerUnavailableError):
            client.batch_next_token_logprobs_sync(contexts(10, 4))
        assert client.runner.slab_name is None and name not in maps_of("self")
        back = ServerProcess.gated("--port", str(server.port))
        try:
            rows = client.batch_next_token_logprobs_sync(contexts(10, 4))
            assert client.runner.slab_name not in (None, name)
            assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts(10, 4)))
        finally:
            client.close()
            back.stop()
    finally:
        client.close()
        server.stop()


def test_a_server_signalled_to_stop_ends_every_session():
    server = ServerProcess.gated()
    try:
        with RemoteLM(server.url) as client:
            client.next_token_logprobs_sync([1])
            name = client.runner.slab_name
            assert name is not None
            server.send_signal(signal.SIGTERM)
            assert server.wait_exit() == 0
    finally:
        server.stop()
    assert name not in maps_of("self")
