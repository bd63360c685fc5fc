"""Load with faults through one server: 8 client processes, 2,000 calls in flight at once,
a fifth of them cancelled, one client killed mid-step and the server killed and restarted.

The server is the gated mock (``serve_gated_server.py``): each batch waits for the
test to open its gate, so the faults land at known points (waits are on output
lines, never on time). Every client checks every row it gets against an in-process
mock bit for bit (``serve_load_client.py``); a call fails only with
``ServerUnavailableError``, and only those in flight when the server went.
"""

from __future__ import annotations

import time

import pytest

from tests.serve_support import ServerProcess, process_env

pytestmark = [pytest.mark.stress, pytest.mark.timeout(600)]

NUM_CLIENTS = 8
CALLS_IN_FLIGHT = 2000
CALLS_AFTER_RESTART = 100
MAX_ROWS = 64  # rows per request: each client needs several steps


def clients_of(url: str) -> list[ServerProcess]:
    per_client = CALLS_IN_FLIGHT // NUM_CLIENTS
    return [
        ServerProcess(
            [
                "tests/serve_load_client.py",
                url,
                str(seed),
                str(per_client),
                str(CALLS_AFTER_RESTART),
            ],
            process_env(),
        )
        for seed in range(NUM_CLIENTS)
    ]


def outcome(client: ServerProcess, name: str) -> tuple[int, int, int]:
    match = client.wait_for(rf"^{name}: answered (\d+) cancelled (\d+) failed (\d+)$", 300)
    return tuple(map(int, match.groups()))  # type: ignore[return-value]


def test_load_with_a_killed_client_and_a_restarted_server(stress_figures):
    start = time.monotonic()
    server = ServerProcess.gated("--gated", "--max-rows", str(MAX_ROWS))
    clients = clients_of(server.url)
    restarted = None
    try:
        for client in clients:
            client.wait_for("^launched$", 120)
        server.wait_for_count("batch started", 1)
        victim = clients[-1]
        victim.process.kill()  # mid-step: the server holds a batch
        victim.wait_exit()
        server.open_gate(1)  # that batch is answered; the next one is held when the server goes
        server.wait_for_count("batch started", 2)
        server.process.kill()
        server.wait_exit()
        survivors = clients[:-1]
        first = [outcome(client, "phase 1") for client in survivors]
        restarted = ServerProcess.gated("--port", str(server.port), "--max-rows", str(MAX_ROWS))
        for client in survivors:
            client.process.stdin.write("\n")  # type: ignore[union-attr]
            client.process.stdin.flush()  # type: ignore[union-attr]
        second = [outcome(client, "phase 2") for client in survivors]
        for client in survivors:
            assert client.wait_exit(120) == 0, client.output
    finally:
        for process in [server, *clients, *([restarted] if restarted else [])]:
            process.stop()
    per_client = CALLS_IN_FLIGHT // NUM_CLIENTS
    assert all(sum(counts) == per_client for counts in first)  # every call accounted for
    assert all(sum(counts) == CALLS_AFTER_RESTART for counts in second)
    assert all(c == per_client // 5 for _, c, _ in first)  # a fifth cancelled, no other lost
    # Each survivor had more rows than two batches hold: some were in flight at the kill.
    assert all(f > 0 for _, _, f in first)
    assert all(f == 0 and a > 0 for a, _, f in second)  # the restarted server answers all
    figures = stress_figures("serve mock")
    figures.served = sum(a for a, _, _ in first + second)
    figures.cancelled = sum(c for _, c, _ in first + second)
    figures.failed_as_intended = sum(f for _, _, f in first)
    figures.wall_s = time.monotonic() - start
