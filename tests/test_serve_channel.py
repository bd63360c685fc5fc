"""A slab session's local channel: ``/v1/logprobs`` frames on a Unix-domain socket.

The server is ``serve_gated_server.py`` (a mock model over 256 byte tokens,
ungated); rows are compared with an in-process ``MockAsyncLM`` over the same
vocabulary, as float32 bytes. Faults of the channel's clients (disconnects,
timeouts, a restarted server, shutdown) are in ``test_serve_faults.py``,
which runs them over the channel and over HTTP.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import msgpack
import pytest
import torch
import urllib3

from genlm_backend import MockAsyncLM
from genlm_backend.errors import RequestTooLargeError, ServerUnavailableError
from genlm_backend.llm.remote import RemoteLM, protocol
from genlm_backend.llm.remote.channel import HAS_UNIX_SOCKETS, LENGTH_BYTES, MAX_HELLO_BYTES, frame
from genlm_backend.llm.remote.protocol import ServeLimits
from genlm_backend.llm.remote.slab import Slab
from genlm_backend.serve import channel as channel_module
from genlm_backend.serve.app import ServeApp
from tests.serve_gated_server import BYTE_VOCAB
from tests.serve_support import ServerProcess, in_thread, wait_until

pytestmark = [
    pytest.mark.skipif(
        not (HAS_UNIX_SOCKETS and Path("/dev/shm").is_dir()),
        reason="Unix-domain sockets and POSIX shared memory",
    ),
    pytest.mark.timeout(120),
]

MAX_BODY_BYTES = 4096
HELLO_TIMEOUT_S = 600.0  # past every socket timeout here: a connection closed is closed at once


@pytest.fixture(scope="module")
def reference():
    return MockAsyncLM(byte_vocab=BYTE_VOCAB)


@pytest.fixture(scope="module")
def server():
    server = ServerProcess.gated(
        "--max-rows", "8", "--max-body-bytes", str(MAX_BODY_BYTES),
        "--hello-timeout-s", str(HELLO_TIMEOUT_S),
    )  # fmt: skip
    yield server
    server.stop()


def test_a_client_on_the_servers_machine_sends_its_batches_over_the_channel(server, reference):
    contexts = [[9, token] for token in range(8)]
    with RemoteLM(server.url) as lm:
        rows = lm.batch_next_token_logprobs_sync(contexts)
        assert lm.runner.num_channel_round_trips == 1
        assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts))
        row = lm.next_token_logprobs_sync([9, 200])
        assert lm.runner.num_channel_round_trips == 2
        assert torch.equal(row, reference.next_token_logprobs_sync([9, 200]))
        with pytest.raises(RequestTooLargeError, match=r"a request body of .* at most 4096"):
            lm.next_token_logprobs_sync(list(range(256)) * 5)  # a frame over the server's limit
        row = lm.next_token_logprobs_sync([9, 201])  # the channel stays open
        assert torch.equal(row, reference.next_token_logprobs_sync([9, 201]))
        assert lm.runner.num_channel_round_trips == 4
    with RemoteLM(server.url, shared_memory=False) as lm:
        assert torch.equal(lm.batch_next_token_logprobs_sync(contexts), rows)
        assert lm.runner.num_channel_round_trips == 0


class Session:
    """A slab session opened by hand: its slab, its id and the server's channel address."""

    def __init__(self, url: str):
        self.slab = Slab.create(4, len(BYTE_VOCAB))
        self._pool = urllib3.connection_from_url(url, timeout=10, retries=False)
        offer = protocol.encode_slab_offer("hand", self.slab.name, self.slab.nonce, 4)
        self._answer = self._pool.request("POST", "/v1/session", body=offer, preload_content=False)
        self._chunks = self._answer.read_chunked()
        fields = protocol.unpack(next(self._chunks))
        assert fields["accepted"], fields
        self.id, self.channel = fields["session"], fields["channel"]
        assert self.channel

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(self.channel)
        return sock

    def close(self) -> None:
        self._answer.release_conn()
        self._pool.close()
        self.slab.close()
        self.slab.unlink()


@pytest.fixture
def session(server):
    session = Session(server.url)
    yield session
    session.close()


def exchange(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(frame(payload))
    return receive(sock)


def receive(sock: socket.socket) -> bytes:
    """One frame's payload; ``b""`` when the server closed the connection instead."""
    header = sock.recv(LENGTH_BYTES, socket.MSG_WAITALL)
    if not header:
        return b""
    length = int.from_bytes(header, "little")
    return sock.recv(length, socket.MSG_WAITALL) if length else b""


def error_of(answer: bytes) -> dict:
    assert answer[:1] == b"E", answer[:80]
    return msgpack.unpackb(answer[1:])


def request(contexts, session: str, slab_row: int = 0) -> bytes:
    return protocol.encode_logprobs_request(
        contexts, [None] * len(contexts), client="hand", session=session, slab_row=slab_row
    )


@pytest.mark.parametrize(
    "hello, reason",
    [
        (protocol.pack({"session": "0" * 32}), "names no open session"),
        (protocol.pack({"other": 1}), "names no open session"),
        (b"\xc1not msgpack", "malformed hello"),
    ],
    ids=["unknown-session", "no-session", "not-msgpack"],
)
def test_a_hello_without_an_open_session_is_refused_and_closed(session, hello, reason):
    with session.connect() as sock:
        error = error_of(exchange(sock, hello))
        assert error["kind"] == "Unauthorized" and reason in error["message"]
        assert receive(sock) == b""  # the server closed it


def test_bad_frames_fail_for_their_request_and_the_channel_keeps_serving(session, reference):
    with session.connect() as sock:
        assert exchange(sock, protocol.pack({"session": session.id})) == b"O"
        error = error_of(exchange(sock, b"\xc1 not a request"))
        assert error["kind"] == "ValueError" and "malformed" in error["message"]
        error = error_of(exchange(sock, request([[1, 300]], session.id)))
        assert error["kind"] == "ValueError" and "300" in error["message"]
        error = error_of(exchange(sock, b"x" * (MAX_BODY_BYTES + 1)))
        assert error["kind"] == "RequestTooLarge", error
        # A frame that answers: its rows in the session's slab, from the row asked.
        answer = exchange(sock, request([[4, 5], [4, 6]], session.id, slab_row=2))
        assert answer[:1] == b"S" and msgpack.unpackb(answer[1:]) == {"num_rows": 2}
        rows = session.slab.read(2, first_row=2)
        assert torch.equal(rows, reference.batch_next_token_logprobs_sync([[4, 5], [4, 6]]))
        # Rows that do not fit the slab come in the frame.
        answer = exchange(sock, request([[4, 7]], session.id, slab_row=4))
        assert answer[:1] == b"R"
        row = protocol.decode_rows(answer[1:], 1, len(BYTE_VOCAB))[0]
        assert torch.equal(row, reference.next_token_logprobs_sync([4, 7]))


def test_closing_a_channel_ends_the_call_waiting_on_it_and_cancels_its_request():
    gated = ServerProcess.gated("--gated")
    try:
        with RemoteLM(gated.url) as lm:
            gated.open_gate()  # for one batch
            lm.next_token_logprobs_sync([1])  # the session and its channel are open
            thread, outcome = in_thread(lm.next_token_logprobs_sync, [2])
            wait_until(lambda: lm.server_stats()[1].num_in_flight == 1)  # held at the gate
            channel = lm.runner._slab.channel  # type: ignore[union-attr]
            channel.close()  # from this thread, while the call waits in the other
            thread.join(timeout=30)
            assert isinstance(outcome.get("error"), ServerUnavailableError), outcome
            gated.wait_for(r"client \w+ \(local channel\) went away")
    finally:
        gated.open_gate()
        gated.stop()


def test_a_connection_that_never_names_its_session_is_closed(monkeypatch):
    monkeypatch.setattr(channel_module, "HELLO_TIMEOUT_S", 0.0)
    app = ServeApp(MockAsyncLM(byte_vocab=BYTE_VOCAB), ServeLimits(), log=lambda message: None)

    async def serve_a_silent_connection() -> bool:
        reader = asyncio.StreamReader()  # nothing ever comes
        closed = asyncio.Event()

        class Writer:
            def get_extra_info(self, name: str):
                return None

            def close(self) -> None:
                closed.set()

        await app.channel.serve_connection(reader, Writer())  # type: ignore[arg-type]
        return closed.is_set()

    assert asyncio.run(serve_a_silent_connection())


# Who may use a channel, and how much of the server one connection may take.


def test_a_hello_over_its_cap_is_closed_unread(session):
    """A hello is a session id: one announcing more than MAX_HELLO_BYTES is not read, though
    it is within the server's body limit (a request's frame of that size would be read)."""
    padded = protocol.pack({"session": session.id, "padding": "x" * MAX_HELLO_BYTES})
    assert MAX_HELLO_BYTES < len(padded) <= MAX_BODY_BYTES
    with session.connect() as sock:
        assert receive_after(sock, frame(padded)) == b""  # closed, though it names the session
    with (
        session.connect() as sock
    ):  # only announced: closed at once, not when the hello's time is up
        assert receive_after(sock, MAX_BODY_BYTES.to_bytes(LENGTH_BYTES, "little")) == b""


def receive_after(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    return receive(sock)


def test_a_request_may_write_only_into_its_own_session_s_slab(server, reference):
    """Another session's id in a request is refused; that session's slab is left as it was."""
    mine, theirs = Session(server.url), Session(server.url)
    try:
        with mine.connect() as sock:
            assert exchange(sock, protocol.pack({"session": mine.id})) == b"O"
            error = error_of(exchange(sock, request([[1, 2]], theirs.id)))
            assert (
                error["kind"] == "Unauthorized" and "its channel's own session" in error["message"]
            )
            assert torch.equal(theirs.slab.read(4), torch.zeros(4, len(BYTE_VOCAB)))
            answer = exchange(sock, request([[1, 2]], mine.id))  # its own: written
            assert answer[:1] == b"S"
            assert torch.equal(mine.slab.read(1)[0], reference.next_token_logprobs_sync([1, 2]))
    finally:
        mine.close()
        theirs.close()


class FakeConnection:
    """A channel connection served in-process: frames fed to its reader, answers collected."""

    def __init__(self, *payloads: bytes, peer: socket.socket | None = None):
        self.payloads = payloads
        self.peer = peer
        self.written = bytearray()

    def reader(self) -> asyncio.StreamReader:
        """A reader of the payloads' frames (made in the loop that serves it)."""
        reader = asyncio.StreamReader()
        for payload in self.payloads:
            reader.feed_data(frame(payload))
        reader.feed_eof()
        return reader

    def get_extra_info(self, name: str):
        return self.peer if name == "socket" else None

    def write(self, data: bytes) -> None:
        self.written += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def answers(self) -> list[bytes]:
        answers, data = [], bytes(self.written)
        while data:
            length = int.from_bytes(data[:LENGTH_BYTES], "little")
            answers.append(data[LENGTH_BYTES : LENGTH_BYTES + length])
            data = data[LENGTH_BYTES + length :]
        return answers


def serve(app: ServeApp, connection: FakeConnection) -> list[bytes]:
    async def run() -> None:
        await app.channel.serve_connection(connection.reader(), connection)  # type: ignore[arg-type]

    asyncio.run(run())
    return connection.answers()


def test_connections_over_the_cap_are_answered_busy():
    app = ServeApp(MockAsyncLM(byte_vocab=BYTE_VOCAB), ServeLimits(), log=lambda message: None)
    app.channel.max_connections = 0
    [answer] = serve(app, FakeConnection(protocol.pack({"session": "x"})))
    error = error_of(answer)
    assert error["kind"] == "Busy" and "1 local connections at most" not in error["message"]
    assert "0 local connections at most" in error["message"]
    assert app.channel.num_connections == 0


def test_the_channel_serves_its_own_user_only(monkeypatch):
    """The peer's user id comes from the kernel (SO_PEERCRED); another user's is refused."""
    if not hasattr(socket, "SO_PEERCRED"):
        pytest.skip("peer credentials are a Linux socket option")
    app = ServeApp(MockAsyncLM(byte_vocab=BYTE_VOCAB), ServeLimits(), log=lambda message: None)
    server_side, client_side = socket.socketpair(socket.AF_UNIX)
    with server_side, client_side:
        assert channel_module._peer_uid(server_side) == channel_module.os.geteuid()
        [answer] = serve(app, FakeConnection(b"\xc1", peer=server_side))
        assert "a malformed hello" in error_of(answer)["message"]  # same user: on to the hello
        real = channel_module.os.geteuid()
        monkeypatch.setattr(channel_module.os, "geteuid", lambda: real + 1)  # as if another user
        [answer] = serve(app, FakeConnection(b"\xc1", peer=server_side))
        error = error_of(answer)
        assert error["kind"] == "Unauthorized" and "its own user only" in error["message"]
