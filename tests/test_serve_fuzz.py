"""Careless and hostile clients against a live server process, beside a well-behaved one.

Hypothesis draws what a client may send: malformed or lying HTTP requests to
every endpoint, hellos and frames on the local channel, slab offers of
segments that are not what they claim, and segments shrunk or grown under an
open session. After each case the server must still run, and a well-behaved
client's rows (shared memory and local channel) must equal an in-process
mock's exactly (float32 bytes).

CI runs few examples per test; ``GENLM_FUZZ_EXAMPLES=500`` runs more (the
figures in BENCHMARKS.md, "serve under fuzzing").
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgpack
import pytest
import torch
import urllib3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm_backend import MockAsyncLM
from genlm_backend.llm.remote import RemoteLM, protocol
from genlm_backend.llm.remote.channel import HAS_UNIX_SOCKETS, LENGTH_BYTES, frame
from genlm_backend.llm.remote.slab import NAME_PREFIX, Slab
from tests.serve_gated_server import BYTE_VOCAB, FAILING_TOKEN
from tests.serve_support import ServerProcess

pytestmark = [
    pytest.mark.skipif(
        not (HAS_UNIX_SOCKETS and Path("/dev/shm").is_dir()),
        reason="Unix-domain sockets and POSIX shared memory",
    ),
    pytest.mark.timeout(600),
]

EXAMPLES = int(os.environ.get("GENLM_FUZZ_EXAMPLES", "15"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MAX_ROWS, MAX_BODY_BYTES = 8, 4096
KINDS = set(protocol.ERROR_STATUS)
VOCAB = len(BYTE_VOCAB)
CASES: dict[str, int] = {}
"""Cases tried by each test (printed at the end of a run, for BENCHMARKS.md)."""


@pytest.fixture(scope="module")
def server():
    server = ServerProcess.gated(
        "--max-rows", str(MAX_ROWS), "--max-body-bytes", str(MAX_BODY_BYTES)
    )
    yield server
    assert server.process.poll() is None, server.output  # never crashed
    server.stop()
    print(f"\nfuzz cases: {CASES}; server alive throughout")


@pytest.fixture(scope="module")
def good(server):
    """A well-behaved client (slab and channel) and the in-process reference."""
    with RemoteLM(server.url) as client:
        yield client, MockAsyncLM(byte_vocab=BYTE_VOCAB)


@pytest.fixture(scope="module")
def raw(server):
    with urllib3.connection_from_url(server.url, timeout=10, retries=False) as pool:
        yield pool


def check_good_client(server: ServerProcess, good, seed: int) -> None:
    client, reference = good
    assert server.process.poll() is None, server.output
    tokens = [token for token in range(VOCAB) if token != FAILING_TOKEN]
    contexts = [
        [tokens[seed % len(tokens)], tokens[(seed * 7 + t) % len(tokens)]] for t in range(4)
    ]
    rows = client.batch_next_token_logprobs_sync(contexts)
    assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts))
    assert client.runner.slab_name is not None  # still through shared memory


def check_answer(response: urllib3.BaseHTTPResponse) -> None:
    """An answer is 200, or an error of a known kind with its status; never a crash."""
    if response.status == 200:
        return
    fields = msgpack.unpackb(response.data)
    assert fields["kind"] in KINDS and protocol.ERROR_STATUS[fields["kind"]] == response.status
    assert fields["kind"] != "ModelError" or "failed" in fields["message"]


# What a body may hold: the protocol's field names with values of any type.
FIELDS = [
    "lengths", "shared", "ids", "lora_names", "lora_versions", "uncached", "client", "session",
    "slab_row", "name", "nonce", "capacity_rows", "op", "path", "what",
]  # fmt: skip
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.binary(max_size=64),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
BODIES = (
    st.binary(max_size=MAX_BODY_BYTES + 64)
    | st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=8).map(protocol.pack)
    | st.builds(
        lambda contexts, names: protocol.encode_logprobs_request(contexts, names[: len(contexts)]),
        st.lists(st.lists(st.integers(-5, 300), max_size=6), min_size=1, max_size=MAX_ROWS + 2),
        st.lists(st.none() | st.text(max_size=4), min_size=MAX_ROWS + 2, max_size=MAX_ROWS + 2),
    )
)
ROUTES = st.sampled_from(
    [("POST", "/v1/logprobs"), ("POST", "/v1/session"), ("POST", "/v1/lora"),
     ("POST", "/v1/clear"), ("GET", "/v1/info"), ("GET", "/v1/stats"), ("PUT", "/v1/nope")]
)  # fmt: skip


@FUZZ
@given(route=ROUTES, body=BODIES, seed=st.integers(0, 10**6))
def test_malformed_http_requests_fail_alone(server, good, raw, route, body, seed):
    CASES["http"] = CASES.get("http", 0) + 1
    method, path = route
    check_answer(raw.request(method, path, body=body))
    check_good_client(server, good, seed)


@FUZZ
@given(
    announced=st.integers(0, 2**31),
    sent=st.binary(max_size=256),
    path=st.sampled_from(["/v1/logprobs", "/v1/session", "/v1/lora"]),
    seed=st.integers(0, 10**6),
)
def test_lying_content_lengths_and_dropped_connections_fail_alone(
    server, good, announced, sent, path, seed
):
    CASES["lying http"] = CASES.get("lying http", 0) + 1
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {announced}\r\n\r\n"
        sock.sendall(head.encode() + sent)
        sock.shutdown(socket.SHUT_WR)  # the body ends short (or long): the client is gone
        while sock.recv(65536):  # whatever the server answers, until it closes
            pass
    check_good_client(server, good, seed)


class HostileSession:
    """A hostile client's own slab session, opened by hand on a connection of its own
    (the session lasts as long as that connection's answer)."""

    def __init__(self, url: str):
        self.slab = Slab.create(4, VOCAB)
        self._pool = urllib3.connection_from_url(url, timeout=10, retries=False)
        offer = protocol.encode_slab_offer("hostile", self.slab.name, self.slab.nonce, 4)
        self._answer = self._pool.request("POST", "/v1/session", body=offer, preload_content=False)
        self._chunks = self._answer.read_chunked()  # kept: a closed generator ends the answer
        fields = protocol.unpack(next(self._chunks))
        assert fields["accepted"], fields
        self.id, self.channel = fields["session"], fields["channel"]

    def close(self) -> None:
        self._answer.release_conn()
        self._pool.close()
        self.slab.close()
        self.slab.unlink()


FRAMES = st.lists(
    st.one_of(
        st.binary(max_size=512).map(frame),  # an honest length, any payload
        st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=64)).map(
            lambda lie: lie[0].to_bytes(LENGTH_BYTES, "little") + lie[1]  # a lying length
        ),
        BODIES.map(frame),
    ),
    max_size=4,
)


@FUZZ
@given(
    hello=st.sampled_from(["own", "other", "random"]),
    random_hello=st.binary(max_size=2048),
    frames=FRAMES,
    seed=st.integers(0, 10**6),
)
def test_hostile_channel_frames_fail_alone(server, good, hello, random_hello, frames, seed):
    CASES["channel"] = CASES.get("channel", 0) + 1
    session = HostileSession(server.url)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(session.channel)
            if hello == "own":
                sock.sendall(frame(protocol.pack({"session": session.id})))
            elif hello == "other":  # the good client's session id is secret: a guess
                sock.sendall(frame(protocol.pack({"session": os.urandom(16).hex()})))
            else:
                sock.sendall(frame(random_hello))
            try:
                for data in frames:
                    sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):
                    pass
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server closed it: a refused hello, or frames sent ahead of answers
    finally:
        session.close()
    check_good_client(server, good, seed)


@FUZZ
@given(
    name=st.sampled_from(["real", "prefix-only", "other"]),
    nonce=st.sampled_from(["right", "wrong"]),
    capacity=st.integers(-3, 2**40),
    resize=st.sampled_from([None, 0, 1, 64, "grow"]),
    mode=st.sampled_from([0o600, 0o644, 0o660]),
    seed=st.integers(0, 10**6),
)
def test_slab_offers_that_are_not_what_they_claim_are_refused(
    server, good, name, nonce, capacity, resize, mode, seed
):
    CASES["slab offers"] = CASES.get("slab offers", 0) + 1
    slab = Slab.create(4, VOCAB)
    try:
        fd = slab._shm._fd
        if resize is not None:
            os.ftruncate(fd, os.fstat(fd).st_size * 2 if resize == "grow" else resize)
        os.fchmod(fd, mode)
        offered = {"real": slab.name, "prefix-only": NAME_PREFIX, "other": "psm_" + slab.name}[name]
        body = protocol.pack(
            {
                "client": "hostile",
                "name": offered,
                "nonce": slab.nonce if nonce == "right" else os.urandom(16),
                "capacity_rows": capacity,
            }
        )
        with urllib3.connection_from_url(server.url, timeout=10, retries=False) as own:
            response = own.request("POST", "/v1/session", body=body, preload_content=False)
            first = (
                next(response.read_chunked(), b"") if response.status == 200 else response.read()
            )
            honest = name == "real" and nonce == "right" and capacity == 4 and resize is None
            if response.status == 200:
                assert protocol.unpack(first)["accepted"] == (honest and mode == 0o600)
            else:
                assert not honest and protocol.unpack(first)["kind"] in KINDS
            response.release_conn()
    finally:
        slab.close()
        slab.unlink()
    check_good_client(server, good, seed)


@FUZZ
@given(size=st.sampled_from([0, 1, 4096, 10**7]), seed=st.integers(0, 10**6))
def test_a_slab_resized_under_its_open_session_cannot_end_the_server(server, good, size, seed):
    CASES["resized slabs"] = CASES.get("resized slabs", 0) + 1
    session = HostileSession(server.url)
    try:
        os.ftruncate(session.slab._shm._fd, size)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(session.channel)
            sock.sendall(frame(protocol.pack({"session": session.id})))
            request = protocol.encode_logprobs_request(
                [[1, seed % FAILING_TOKEN], [2, 3]],
                [None, None],
                client="hostile",
                session=session.id,
            )
            sock.sendall(frame(request))
            assert sock.recv(LENGTH_BYTES + 1, socket.MSG_WAITALL)[LENGTH_BYTES:] == b"O"
            header = sock.recv(LENGTH_BYTES, socket.MSG_WAITALL)
            payload = sock.recv(int.from_bytes(header, "little"), socket.MSG_WAITALL)
            assert payload[:1] in (b"S", b"R")  # in its (extended) slab, or in the frame
    finally:
        session.close()
    check_good_client(server, good, seed)
