"""Careless and hostile clients against a live server process, beside a well-behaved one.

Hypothesis draws what a client may send: malformed or lying HTTP requests to
every endpoint, hellos and frames on the local channel, slab offers of
segments that are not what they claim, and segments shrunk or grown under an
open session. After each case the server must still run, and a well-behaved
client (no output cache of its own: each check is a round trip, counted) must
get rows equal to an in-process mock's exactly (float32 bytes), through shared
memory and the local channel; so must the rows a hostile client is answered.

Every branch of the strategies is reached in CI's few examples (the rare ones
through ``@example``): ``tests/strategy_branches.py`` checks it and prints the
count of examples reaching each branch at the end of the run.
``GENLM_FUZZ_EXAMPLES=500`` runs more (the figures in BENCHMARKS.md, "serve
under fuzzing").
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import msgpack
import pytest
import torch
import urllib3
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from genlm_backend import MockAsyncLM
from genlm_backend.llm.remote import RemoteLM, protocol
from genlm_backend.llm.remote.channel import HAS_UNIX_SOCKETS, LENGTH_BYTES, frame
from genlm_backend.llm.remote.slab import HAS_SEALED, NAME_PREFIX, SEALED_PREFIX, Slab, slab_bytes
from tests.serve_gated_server import BYTE_VOCAB, FAILING_TOKEN
from tests.serve_support import ServerProcess
from tests.strategy_branches import Branches

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
HANG_S = 60.0  # the good client's read timeout: a hang guard, never reached by a correct build
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
def reference():
    return MockAsyncLM(byte_vocab=BYTE_VOCAB)


@pytest.fixture(scope="module")
def good(server, reference):
    """A well-behaved client (slab and channel) without an output cache, and the in-process
    reference: every check of its rows is a round trip to the server."""
    with RemoteLM(server.url, output_cache_bytes=0, read_timeout_s=HANG_S) as client:
        yield client, reference


@pytest.fixture(scope="module")
def raw(server):
    with urllib3.connection_from_url(server.url, timeout=10, retries=False) as pool:
        yield pool


@pytest.fixture
def branches(request):
    """The test's :class:`Branches`: at its end, every expected branch must have been reached."""
    name = request.node.originalname
    tally = Branches(request.node.nodeid, BRANCHES[name])
    yield tally
    CASES[name] = tally.counts["examples"]
    tally.check()


def check_good_client(server: ServerProcess, good, seed: int) -> None:
    """The server still runs and answers the good client, through shared memory, the
    mock's rows exactly (a round trip: the client keeps no rows of its own)."""
    client, reference = good
    assert server.process.poll() is None, server.output
    tokens = [token for token in range(VOCAB) if token != FAILING_TOKEN]
    contexts = [
        [tokens[seed % len(tokens)], tokens[(seed * 7 + t) % len(tokens)]] for t in range(4)
    ]
    round_trips = client.runner.num_channel_round_trips
    rows = client.batch_next_token_logprobs_sync(contexts)
    assert client.runner.num_channel_round_trips == round_trips + 1  # it reached the server
    assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts))
    assert client.runner.slab_name is not None  # still through shared memory


def check_answer(response: urllib3.BaseHTTPResponse) -> str:
    """An answer is 200, or an error of a known kind with its status; never a crash.
    Returns which (a branch)."""
    if response.status == 200:
        return "answered 200"
    fields = msgpack.unpackb(response.data)
    assert fields["kind"] in KINDS and protocol.ERROR_STATUS[fields["kind"]] == response.status
    assert fields["kind"] != "ModelError" or "failed" in fields["message"]
    return "answered an error"


# What a body may hold: the protocol's field names with values of any type. Each body
# strategy draws (its kind, its bytes).
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
    st.tuples(st.just("raw bytes"), st.binary(max_size=MAX_BODY_BYTES + 64))
    | st.tuples(
        st.just("protocol fields"),
        st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=8).map(protocol.pack),
    )
    | st.tuples(
        st.just("logprobs request"),
        st.builds(
            lambda contexts, names: protocol.encode_logprobs_request(
                contexts, names[: len(contexts)]
            ),
            st.lists(st.lists(st.integers(-5, 300), max_size=6), min_size=1, max_size=MAX_ROWS + 2),
            st.lists(st.none() | st.text(max_size=4), min_size=MAX_ROWS + 2, max_size=MAX_ROWS + 2),
        ),
    )
)
BODY_KINDS = ["raw bytes", "protocol fields", "logprobs request"]
ROUTES = [
    ("POST", "/v1/logprobs"), ("POST", "/v1/session"), ("POST", "/v1/lora"), ("POST", "/v1/clear"),
    ("GET", "/v1/info"), ("GET", "/v1/stats"), ("PUT", "/v1/nope"),
]  # fmt: skip
A_REQUEST = ("logprobs request", protocol.encode_logprobs_request([[1, 2], [3]], [None, None]))
LYING = ["announced over the limit", "body short of it", "body as announced", "body past it"]
LYING_PATHS = ["/v1/logprobs", "/v1/session", "/v1/lora"]
HELLOS = ["own", "other", "random"]
FRAME_KINDS = ["an honest length", "a lying length", "a protocol body"]
NAMES, NONCES = ["real", "prefix-only", "other"], ["right", "wrong"]
CAPACITIES = ["capacity as made", "another capacity", "no capacity"]
RESIZES, MODES = [None, 0, 1, 64, "grow"], [0o600, 0o644, 0o660]
OFFER_OUTCOMES = ["honest offer accepted", "honest offer of a shared segment refused", "refused"]
SIZES = [0, 1, 4096, 10**7]
SLAB_KINDS = ["sealed", "named"] if HAS_SEALED else ["named"]
"""A sealed ``memfd`` (the server maps it) and a named segment (it writes a descriptor)."""
BRANCHES = {
    "test_malformed_http_requests_fail_alone": [
        *(f"{method} {path}" for method, path in ROUTES),
        *BODY_KINDS,
        "answered 200",
        "answered an error",
    ],
    "test_lying_content_lengths_and_dropped_connections_fail_alone": [*LYING_PATHS, *LYING],
    "test_hostile_channel_frames_fail_alone": [
        *(f"hello: {hello}" for hello in HELLOS),
        *FRAME_KINDS,
        "no frame",
    ],
    "test_slab_offers_that_are_not_what_they_claim_are_refused": [
        *(f"name: {name}" for name in NAMES),
        *(f"nonce: {nonce}" for nonce in NONCES),
        *CAPACITIES,
        *(f"resize: {resize}" for resize in RESIZES),
        *(f"mode: {mode:o}" for mode in MODES),
        *(f"kind: {kind}" for kind in SLAB_KINDS),
        *OFFER_OUTCOMES,
    ],
    "test_a_slab_resized_under_its_open_session_cannot_end_the_server": [
        *(f"size: {size}" for size in SIZES),
        *(f"kind: {kind}" for kind in SLAB_KINDS),
    ],
}
"""Every branch each test's examples must reach (its strategies' values and the outcomes
that depend on them)."""


@FUZZ
@given(route=st.sampled_from(ROUTES), body=BODIES, seed=st.integers(0, 10**6))
@example(route=ROUTES[0], body=A_REQUEST, seed=1)  # answered 200
@example(route=ROUTES[1], body=("raw bytes", b""), seed=2)
@example(route=ROUTES[2], body=("protocol fields", protocol.pack({"op": "add"})), seed=3)
@example(route=ROUTES[3], body=("protocol fields", protocol.pack({"what": "all"})), seed=4)
@example(route=ROUTES[4], body=A_REQUEST, seed=5)
@example(route=ROUTES[5], body=("raw bytes", b"\xc1"), seed=6)
@example(route=ROUTES[6], body=("logprobs request", b""), seed=7)  # answered an error
def test_malformed_http_requests_fail_alone(server, good, raw, branches, route, body, seed):
    (method, path), (kind, data) = route, body
    outcome = check_answer(raw.request(method, path, body=data))
    branches.example(f"{method} {path}", kind, outcome)
    check_good_client(server, good, seed)


def lying_branch(announced: int, sent: bytes) -> str:
    if announced > MAX_BODY_BYTES:
        return "announced over the limit"
    return LYING[1 + (announced <= len(sent)) + (announced < len(sent))]


@FUZZ
@given(
    announced=st.integers(0, 2**31),
    sent=st.binary(max_size=256),
    path=st.sampled_from(LYING_PATHS),
    seed=st.integers(0, 10**6),
)
@example(announced=2**31, sent=b"x", path=LYING_PATHS[0], seed=1)
@example(announced=9, sent=b"x", path=LYING_PATHS[1], seed=2)
@example(announced=3, sent=b"abc", path=LYING_PATHS[2], seed=3)
@example(announced=1, sent=b"abc", path=LYING_PATHS[0], seed=4)
def test_lying_content_lengths_and_dropped_connections_fail_alone(
    server, good, branches, announced, sent, path, seed
):
    branches.example(path, lying_branch(announced, sent))
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

    def __init__(self, url: str, sealed: bool | None = None):
        self.slab = Slab.create(4, VOCAB, sealed)
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
        st.tuples(st.just(FRAME_KINDS[0]), st.binary(max_size=512).map(frame)),
        st.tuples(
            st.just(FRAME_KINDS[1]),
            st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=64)).map(
                lambda lie: lie[0].to_bytes(LENGTH_BYTES, "little") + lie[1]
            ),
        ),
        BODIES.map(lambda body: (FRAME_KINDS[2], frame(body[1]))),
    ),
    max_size=4,
)
A_LYING_FRAME = (FRAME_KINDS[1], (1 << 20).to_bytes(LENGTH_BYTES, "little") + b"short")


@FUZZ
@given(
    hello=st.sampled_from(HELLOS),
    random_hello=st.binary(max_size=2048),
    frames=FRAMES,
    seed=st.integers(0, 10**6),
)
@example(hello="own", random_hello=b"", frames=[(FRAME_KINDS[2], frame(A_REQUEST[1]))], seed=1)
@example(hello="other", random_hello=b"", frames=[], seed=2)
@example(hello="random", random_hello=b"\x81", frames=[(FRAME_KINDS[0], frame(b""))], seed=3)
@example(hello="own", random_hello=b"", frames=[A_LYING_FRAME], seed=4)
def test_hostile_channel_frames_fail_alone(
    server, good, branches, hello, random_hello, frames, seed
):
    branches.example(f"hello: {hello}", *({kind for kind, _ in frames} or {"no frame"}))
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
                for _, data in frames:
                    sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):
                    pass
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server closed it: a refused hello, or frames sent ahead of answers
    finally:
        session.close()
    check_good_client(server, good, seed)


def capacity_branch(capacity: int) -> str:
    return CAPACITIES[0] if capacity == 4 else CAPACITIES[1] if capacity > 0 else CAPACITIES[2]


@FUZZ
@given(
    name=st.sampled_from(NAMES),
    nonce=st.sampled_from(NONCES),
    capacity=st.integers(-3, 2**40),
    resize=st.sampled_from(RESIZES),
    mode=st.sampled_from(MODES),
    kind=st.sampled_from(SLAB_KINDS),
    seed=st.integers(0, 10**6),
)
@example(name="real", nonce="right", capacity=4, resize=None, mode=0o600, kind="named", seed=1)
@example(name="real", nonce="right", capacity=4, resize=None, mode=0o644, kind="named", seed=2)
@example(name="prefix-only", nonce="wrong", capacity=0, resize=0, mode=0o660, kind="named", seed=3)
@example(name="other", nonce="right", capacity=5, resize=1, mode=0o600, kind="named", seed=4)
@example(name="real", nonce="wrong", capacity=-3, resize=64, mode=0o644, kind="named", seed=5)
@example(name="real", nonce="right", capacity=4, resize="grow", mode=0o600, kind="named", seed=6)
@example(name="real", nonce="right", capacity=4, resize=0, mode=0o600, kind=SLAB_KINDS[0], seed=7)
@example(
    name="other", nonce="right", capacity=4, resize=None, mode=0o600, kind=SLAB_KINDS[0], seed=8
)
def test_slab_offers_that_are_not_what_they_claim_are_refused(
    server, good, branches, name, nonce, capacity, resize, mode, kind, seed
):
    slab = Slab.create(4, VOCAB, sealed=kind == "sealed")
    unsealed = -1
    try:
        fd, size = slab.fd, os.fstat(slab.fd).st_size
        if resize is not None:
            # The kernel refuses to shrink a sealed slab; anything may grow.
            refused = slab.is_sealed and resize != "grow"
            with pytest.raises(PermissionError) if refused else contextlib.nullcontext():
                os.ftruncate(fd, size * 2 if resize == "grow" else resize)
        os.fchmod(fd, mode)
        if slab.is_sealed:  # "other": a segment like the slab in all but its seal
            unsealed = os.memfd_create(NAME_PREFIX + "unsealed", os.MFD_ALLOW_SEALING)
            os.fchmod(unsealed, mode)
            os.pwrite(unsealed, slab.nonce, 0)
            os.ftruncate(unsealed, slab_bytes(4, VOCAB))
            other = f"{SEALED_PREFIX}{os.getpid()}:{unsealed}"
            offered = {"real": slab.name, "prefix-only": SEALED_PREFIX, "other": other}[name]
        else:
            offered = {"real": slab.name, "prefix-only": NAME_PREFIX, "other": "psm_" + slab.name}
            offered = offered[name]
        resized = os.fstat(fd).st_size != size
        honest = name == "real" and nonce == "right" and capacity == 4 and not resized
        outcome = OFFER_OUTCOMES[0 if honest and mode == 0o600 else 1 if honest else 2]
        branches.example(
            f"name: {name}", f"nonce: {nonce}", capacity_branch(capacity), f"resize: {resize}",
            f"mode: {mode:o}", f"kind: {kind}", outcome,
        )  # fmt: skip
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
            # An accepted offer's answer is a stream (the session lasts as long as it does).
            first = next(response.read_chunked(), b"") if response.chunked else response.read()
            if response.status == 200:
                assert protocol.unpack(first)["accepted"] == (outcome == OFFER_OUTCOMES[0])
            else:
                assert not honest and protocol.unpack(first)["kind"] in KINDS
            response.release_conn()
    finally:
        slab.close()
        slab.unlink()
        if unsealed >= 0:
            os.close(unsealed)
    check_good_client(server, good, seed)


@FUZZ
@given(size=st.sampled_from(SIZES), kind=st.sampled_from(SLAB_KINDS), seed=st.integers(0, 10**6))
@example(size=SIZES[0], kind="named", seed=1)
@example(size=SIZES[1], kind="named", seed=2)
@example(size=SIZES[2], kind="named", seed=3)
@example(size=SIZES[3], kind="named", seed=4)
@example(size=SIZES[0], kind=SLAB_KINDS[0], seed=5)
@example(size=SIZES[3], kind=SLAB_KINDS[0], seed=6)
def test_a_slab_resized_under_its_open_session_cannot_end_the_server(
    server, good, reference, branches, size, kind, seed
):
    session = HostileSession(server.url, sealed=kind == "sealed")
    contexts = [[1, seed % FAILING_TOKEN], [2, 3]]
    try:
        fd = session.slab.fd
        shrinks = size < os.fstat(fd).st_size
        with (
            pytest.raises(PermissionError)
            if session.slab.is_sealed and shrinks
            else (contextlib.nullcontext())
        ):  # the kernel refuses to shrink a sealed slab, which the server maps
            os.ftruncate(fd, size)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(session.channel)
            sock.sendall(frame(protocol.pack({"session": session.id})))
            request = protocol.encode_logprobs_request(
                contexts, [None, None], client="hostile", session=session.id
            )
            sock.sendall(frame(request))
            assert sock.recv(LENGTH_BYTES + 1, socket.MSG_WAITALL)[LENGTH_BYTES:] == b"O"
            header = sock.recv(LENGTH_BYTES, socket.MSG_WAITALL)
            payload = sock.recv(int.from_bytes(header, "little"), socket.MSG_WAITALL)
        branches.example(f"size: {size}", f"kind: {kind}")
        if payload[:1] == b"S":  # in its slab, extended again by the server's write
            rows = session.slab.read(len(contexts))
        else:  # in the frame (the server could not write the slab)
            assert payload[:1] == b"R", payload[:80]
            rows = protocol.decode_rows(payload[1:], len(contexts), VOCAB)
        assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts))
    finally:
        session.close()
    check_good_client(server, good, seed)
