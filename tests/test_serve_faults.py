"""Trust and faults of ``genlm-backend serve``, each with real processes on 127.0.0.1.

The server is ``serve_gated_server.py``: a mock model over 256 byte tokens
whose batches, with ``--gated``, wait for the test to open a gate. So a
test can hold a batch in flight, then disconnect a client, kill or signal
the server, in a known order (waits are on the server's output lines).
"""

from __future__ import annotations

import gc
import signal
import threading
import time
import warnings
import weakref

import pytest
import torch
import urllib3

from genlm_backend import MockAsyncLM
from genlm_backend.cli import main as cli_main
from genlm_backend.errors import (
    RemoteModelError,
    RequestTooLargeError,
    ServerModelChangedError,
    ServerRejectedError,
    ServerUnavailableError,
)
from genlm_backend.llm.remote import RemoteLM, protocol
from genlm_backend.llm.runner import Request
from genlm_backend.serve import server as server_module
from genlm_backend.serve.server import check_binding, frozen_heap, is_loopback
from tests.serve_gated_server import BYTE_VOCAB, FAILING_TOKEN
from tests.serve_support import ServerProcess, in_thread, process_env, wait_until

pytestmark = pytest.mark.timeout(120)

ERROR_DEADLINE_S = 10.0  # a client learns that its server went away within this


@pytest.fixture(scope="module")
def reference():
    return MockAsyncLM(byte_vocab=BYTE_VOCAB)


@pytest.fixture
def gated_server():
    server = ServerProcess.gated("--gated")
    yield server
    server.stop()


def test_requests_of_different_clients_share_one_batch(gated_server):
    """While batch 1 computes, two client processes send 8 rows each: batch 2 holds all 16.

    The server waits for the first client to come back (it just answered it) until
    that client closes: then it knows the client has left, and lets the others go.
    """
    script = (
        "import sys; from genlm_backend.serve import RemoteLM\n"
        "lm = RemoteLM(sys.argv[1])\n"
        "rows = lm.batch_next_token_logprobs_sync([[int(sys.argv[2]), t] for t in range(8)])\n"
        "print('rows', tuple(rows.shape), flush=True)\n"
    )
    first = RemoteLM(gated_server.url)
    try:
        thread, outcome = in_thread(first.next_token_logprobs_sync, [1])
        gated_server.wait_for("batch started: 1 rows")
        clients = [ServerProcess(["-c", script, gated_server.url, str(i)]) for i in (2, 3)]
        try:
            # Both clients' requests are on the server, held until the first client's batch is done.
            wait_until(lambda: first.server_stats()[1].num_in_flight == 3, timeout_s=60)
            gated_server.open_gate(2)
            thread.join(timeout=10)
            assert outcome["result"].shape == (256,)
            first.close()
            gated_server.wait_for("batch started: 16 rows")
            for client in clients:
                client.wait_for(r"rows \(8, 256\)")
        finally:
            for client in clients:
                client.stop()
    finally:
        first.close()
    assert gated_server.output.count("batch started") == 2


def test_rows_the_server_holds_are_answered_while_a_batch_computes(gated_server, reference):
    """A request whose every row the server holds needs no model work: it waits neither for
    the batch computing nor for the clients the step gather expects back."""
    contexts = [[7, t] for t in range(4)]
    with RemoteLM(gated_server.url) as first, RemoteLM(gated_server.url) as second:
        computing, outcome = in_thread(first.batch_next_token_logprobs_sync, contexts)
        gated_server.wait_for("batch started: 4 rows")
        gated_server.open_gate()
        computing.join(timeout=10)
        held = outcome["result"]
        hits_before = second.server_stats()[0].num_output_cache_hits
        computing, outcome = in_thread(first.next_token_logprobs_sync, [1])
        try:
            gated_server.wait_for("batch started: 1 rows")  # now gated: a batch computes
            # ``second`` has no rows of its own yet: its call is one round trip.
            rows, held_outcome = in_thread(second.batch_next_token_logprobs_sync, contexts)
            rows.join(timeout=ERROR_DEADLINE_S)
            assert not rows.is_alive(), "held rows waited for the batch computing"
            server_lm, server = second.server_stats()
            assert server.num_in_flight == 1  # only the gated batch's request
        finally:
            gated_server.open_gate()
        computing.join(timeout=10)
        assert outcome["result"].shape == (256,)
    assert torch.equal(held_outcome["result"], held)
    want = reference.batch_next_token_logprobs_sync(contexts)
    torch.testing.assert_close(held_outcome["result"], want, rtol=0, atol=1e-6)
    assert server_lm.num_output_cache_hits == hits_before + len(contexts)
    assert gated_server.output.count("batch started") == 2


# Over a slab session's local channel (the default on the server's machine), or HTTP:
# how a client's going away shows in the server's log.
TRANSPORTS = {
    "channel": (True, r"client \w+ \(local channel\) went away"),
    "http": (False, r"client 127\.0\.0\.1:\d+ went away"),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_that_disconnects_cancels_its_pending_requests(gated_server, transport):
    shared_memory, went_away = TRANSPORTS[transport]
    script = (
        "import sys; from genlm_backend.serve import RemoteLM\n"
        f"lm = RemoteLM(sys.argv[1], shared_memory={shared_memory}); print('connected', flush=True)\n"
        "lm.batch_next_token_logprobs_sync([[5, t] for t in range(3)])\n"
    )
    with RemoteLM(gated_server.url) as survivor:
        thread, outcome = in_thread(survivor.next_token_logprobs_sync, [1])
        gated_server.wait_for("batch started: 1 rows")
        leaving = ServerProcess(["-c", script, gated_server.url])
        try:
            wait_until(lambda: survivor.server_stats()[1].num_in_flight == 2, timeout_s=60)
            leaving.process.kill()
            gated_server.wait_for(went_away)
        finally:
            leaving.stop()
        gated_server.open_gate()
        thread.join(timeout=10)
        assert outcome["result"].shape == (256,)
        lm_stats, serve_stats = survivor.server_stats()
    assert lm_stats.num_contexts_computed == 1  # the 3 queued contexts cost no model work
    assert serve_stats.num_cancelled_by_disconnect == 1
    assert serve_stats.num_in_flight == 0


def test_a_server_that_dies_fails_the_client_once_and_is_used_again_when_back(reference):
    server = ServerProcess.gated("--gated")
    try:
        client = RemoteLM(server.url)
        thread, outcome = in_thread(client.next_token_logprobs_sync, [7, 8])
        server.wait_for("batch started: 1 rows")
        killed_at = time.monotonic()
        server.process.kill()
        thread.join(timeout=ERROR_DEADLINE_S)
        assert isinstance(outcome.get("error"), ServerUnavailableError), outcome
        assert "stopped or crashed" in str(outcome["error"])
        assert outcome["ended_at"] - killed_at < ERROR_DEADLINE_S
        server.wait_exit()  # its listening socket is gone with it
        with pytest.raises(ServerUnavailableError, match="cannot reach"):
            client.next_token_logprobs_sync([7, 8])  # nothing listens now
    finally:
        server.stop()
    back = ServerProcess.gated("--port", str(server.port))
    try:
        row = client.next_token_logprobs_sync([7, 8])  # the same client, reconnected
        assert torch.equal(row, reference.next_token_logprobs_sync([7, 8]))
    finally:
        client.close()
        back.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_server_that_hangs_fails_the_client_after_its_read_timeout(gated_server, transport):
    """The gate stands for a hung server (or a dead network): the answer never comes."""
    shared_memory, went_away = TRANSPORTS[transport]
    with RemoteLM(gated_server.url, read_timeout_s=2.0, shared_memory=shared_memory) as client:
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="no answer in time"):
            client.next_token_logprobs_sync([3])
        assert time.monotonic() - started < ERROR_DEADLINE_S
        assert client.runner.slab_name is None  # the server may still write into it: dropped
        # The client gave up and closed its connection: the server cancels the request.
        gated_server.wait_for(went_away)
        gated_server.open_gate()
        gated_server.wait_for("batch started: 1 rows")
        assert client.next_token_logprobs_sync([3]).shape == (256,)  # cached by the first batch
        assert (client.runner.slab_name is not None) == shared_memory  # a new slab


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_fails_pending_requests_clearly_and_stops_the_server(gated_server, sig):
    with RemoteLM(gated_server.url) as computing, RemoteLM(gated_server.url) as queued:
        first, first_outcome = in_thread(computing.next_token_logprobs_sync, [1])
        gated_server.wait_for("batch started: 1 rows")
        second, second_outcome = in_thread(queued.next_token_logprobs_sync, [2])
        wait_until(lambda: computing.server_stats()[1].num_in_flight == 2)
        gated_server.send_signal(sig)
        first.join(timeout=ERROR_DEADLINE_S)
        second.join(timeout=ERROR_DEADLINE_S)
        for outcome in (first_outcome, second_outcome):
            assert isinstance(outcome.get("error"), ServerUnavailableError), outcome
            assert f"shutting down ({sig.name})" in str(outcome["error"])
        gated_server.open_gate()  # the batch computing in the model's thread may end
        assert gated_server.wait_exit() == 0
    gated_server.wait_for(rf"shutting down \({sig.name}\): failing 2 request")
    gated_server.wait_for("stopped")


def test_a_token_is_required_when_set():
    server = ServerProcess.gated("--token", "s3cret")
    try:
        with pytest.raises(ServerRejectedError, match="got no token"):
            RemoteLM(server.url)
        with pytest.raises(ServerRejectedError, match="got a wrong token"):
            RemoteLM(server.url, token="guess")
        with RemoteLM(server.url, token="s3cret") as lm:
            assert lm.next_token_logprobs_sync([1]).shape == (256,)
            assert lm.runner.slab_name is not None  # the slab's offer carried the token too
        offer = protocol.encode_slab_offer("client", "genlm-serve-x", bytes(16), 1)
        with urllib3.connection_from_url(server.url, timeout=10, retries=False) as raw:
            assert raw.request("POST", "/v1/session", body=offer).status == 401
        env_client = "from genlm_backend.serve import RemoteLM; import sys; RemoteLM(sys.argv[1])"
        client = ServerProcess(
            ["-c", env_client + "; print('ok')", server.url],
            process_env(GENLM_SERVE_TOKEN="s3cret"),
        )
        client.wait_for("^ok$")
        client.stop()
        assert "no token" not in server.output
    finally:
        server.stop()


def test_a_server_without_a_token_says_at_start_who_can_use_it(gated_server):
    gated_server.wait_for(
        r"no token: every user of this machine can reach 127\.0\.0\.1:\d+ and use this model "
        r"\(the local channel serves this user only\); set GENLM_SERVE_TOKEN or pass --token-file"
    )


def test_non_loopback_needs_the_flag_and_a_token(capsys):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    check_binding("127.0.0.1", allow_remote=False, token=None)
    check_binding("0.0.0.0", allow_remote=True, token="t")
    # The command refuses before loading any model (nothing is bound here).
    assert cli_main(["serve", "--backend", "mock", "--host", "0.0.0.0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert cli_main(["serve", "--backend", "mock", "--host", "0.0.0.0", "--allow-remote"]) == 2
    assert "needs a shared token" in capsys.readouterr().err


def test_a_server_serves_with_the_heap_it_started_with_out_of_full_collections(monkeypatch):
    """The objects alive when serving starts (the model's) are frozen while the loop runs,
    after garbage among them is collected; thawed when it stops."""
    if gc.get_freeze_count():
        gc.unfreeze()  # pragma: no cover - another module froze objects
    seen = {}

    class Cycle:  # garbage only a collection frees: it must not be frozen
        pass

    def fake_run(coroutine):
        coroutine.close()  # the server's loop, not run here
        seen["frozen"] = gc.get_freeze_count()
        seen["garbage_left"] = garbage() is not None

    lm = MockAsyncLM(byte_vocab=BYTE_VOCAB)
    cycle = Cycle()
    cycle.me = cycle
    garbage = weakref.ref(cycle)
    del cycle
    monkeypatch.setattr(server_module.asyncio, "run", fake_run)
    server_module.serve(lm, log=lambda message: None)
    assert seen["frozen"] > 0 and not seen["garbage_left"]
    assert gc.get_freeze_count() == 0  # thawed once serving stopped
    lm.close()


def test_a_heap_the_process_froze_itself_stays_frozen(monkeypatch):
    """Neither collected, frozen again nor thawed. (Counts of frozen objects are not compared:
    a frozen object that other threads let go of leaves the count meanwhile.)"""
    if gc.get_freeze_count():
        gc.unfreeze()  # pragma: no cover - another module froze objects
    gc.freeze()
    calls = []
    this_thread = threading.get_ident()

    def spy(name: str, real):
        def call(*args):
            if threading.get_ident() != this_thread:  # another thread's own business
                return real(*args)
            calls.append(name)
            return None

        return call

    try:
        for name in ("collect", "freeze", "unfreeze"):
            monkeypatch.setattr(gc, name, spy(name, getattr(gc, name)))
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0 and calls == []  # not thawed by the server
    finally:
        monkeypatch.undo()
        gc.unfreeze()


def test_oversized_and_malformed_requests_fail_for_their_client_only(reference):
    server = ServerProcess.gated(
        "--max-rows", "4", "--max-context-length", "8", "--max-body-bytes", "2048"
    )
    try:
        with urllib3.connection_from_url(server.url, timeout=10, retries=False) as raw:

            def post(body: bytes) -> urllib3.BaseHTTPResponse:
                return raw.request("POST", "/v1/logprobs", body=body)

            def logprobs(contexts) -> urllib3.BaseHTTPResponse:
                return post(protocol.encode_logprobs_request(contexts, [None] * len(contexts)))

            def offer(body: bytes) -> urllib3.BaseHTTPResponse:
                return raw.request("POST", "/v1/session", body=body)

            def slab_offer(capacity_rows: int = 1, name: str = "genlm-serve-none") -> bytes:
                return protocol.encode_slab_offer("client", name, bytes(16), capacity_rows)

            cases = [
                (
                    logprobs([[1]] * 5),
                    413,
                    "5 contexts in one request; this server takes at most 4",
                ),
                (logprobs([[1] * 9]), 413, "a context of 9 tokens; this server takes at most 8"),
                (post(b"x" * 3000), 413, "this server takes at most 2048"),
                (post(b"\xc1garbage"), 400, "not msgpack"),
                (post(protocol.pack({"lengths": [2], "ids": b"\0" * 4})), 400, "'shared'"),
                (
                    post(protocol.pack({"lengths": [2], "shared": [0], "ids": b"\0" * 8})),
                    400,
                    "lora_names",
                ),
                (
                    post(
                        protocol.pack(
                            {
                                "lengths": [2, 3],
                                "shared": [0, 3],
                                "ids": b"\0" * 8,
                                "lora_names": [None] * 2,
                            }
                        )
                    ),
                    400,
                    "each 'shared' entry is an int from 0 to the length",
                ),
                (logprobs([[256]]), 400, "outside the vocabulary"),
                (offer(b"\xc1garbage"), 400, "not msgpack"),
                (offer(protocol.pack({"client": "c", "name": 1})), 400, "'name' (str)"),
                (offer(slab_offer(capacity_rows=13)), 413, "a slab of 13 rows"),
                (
                    post(protocol.encode_logprobs_request([[1]], [None], slab_row=12)),
                    400,
                    "'slab_row' must be an int in [0, 12)",
                ),
            ]
            for response, status, message in cases:
                assert response.status == status
                assert message in protocol.unpack(response.data)["message"]
            refused = protocol.unpack(offer(slab_offer()).data)  # not an error: an answer
            assert not refused["accepted"] and "cannot open shared memory" in refused["reason"]
        with RemoteLM(server.url) as lm:
            assert lm.max_context_length == 8
            with pytest.raises(ValueError, match="more than the model's context of 8"):
                lm.next_token_logprobs_sync([1] * 9)  # refused in the client already
            round_trips = lm.runner.num_round_trips
            contexts = [[1, t] for t in range(10)]
            rows = lm.batch_next_token_logprobs_sync(contexts)  # batches of at most 4 rows
            assert lm.runner.num_round_trips - round_trips == 3
            assert torch.equal(rows, reference.batch_next_token_logprobs_sync(contexts))
            with pytest.raises(RequestTooLargeError, match="at most 4"):
                lm.runner.run([Request(None, (1,))] * 5)
    finally:
        server.stop()


def test_a_model_error_fails_its_batch_only_and_the_server_goes_on(reference):
    server = ServerProcess.gated()
    try:
        with RemoteLM(server.url) as client:
            with pytest.raises(RemoteModelError, match="RuntimeError: the model failed this batch"):
                client.next_token_logprobs_sync([1, FAILING_TOKEN])
            assert torch.equal(
                client.next_token_logprobs_sync([1, 2]), reference.next_token_logprobs_sync([1, 2])
            )
    finally:
        server.stop()


def test_a_server_back_with_another_model_is_refused():
    server = ServerProcess.gated()
    client = RemoteLM(server.url)
    try:
        client.next_token_logprobs_sync([1])
        server.stop()
        other = ServerProcess.gated("--port", str(server.port), "--vocab-size", "128")
        try:
            # The refused session's open answer is closed with it, not left to the collector.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ResourceWarning)
                with pytest.raises(ServerModelChangedError, match="now serves another model"):
                    client.next_token_logprobs_sync([2])
                gc.collect()
            assert not [w for w in caught if "unclosed" in str(w.message)], caught
        finally:
            other.stop()
    finally:
        client.close()
        server.stop()
