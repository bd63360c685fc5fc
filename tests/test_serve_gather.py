"""The server's step gather (``genlm_backend.serve.gather``), on one event loop, no server.

Group durations come from a clock the test sets: a group "took" ``LONG_S``
(its clients are waited for longer than any test runs) or 0 s (a client
that is not back is not waited for). Order is checked with the gather's own
state (``num_held``), never with sleeps.
"""

from __future__ import annotations

import ast
import asyncio

import pytest

from genlm_backend import MockAsyncLM
from genlm_backend.serve import RemoteLM
from genlm_backend.serve.gather import StepGather
from tests.serve_gated_server import BYTE_VOCAB
from tests.serve_support import ServerProcess

LONG_S = 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def held(gather: StepGather, client: str) -> asyncio.Future:
    """``client``'s request, started and seen held by the gather."""
    num_held = gather.stats.num_held
    request = asyncio.ensure_future(gather.admit(client))
    while gather.stats.num_held == num_held and not request.done():
        await asyncio.sleep(0)
    assert not request.done(), "expected the request to be held"
    return request


async def a_group_that_took(gather: StepGather, clock: Clock, seconds: float, *clients: str):
    """Let ``clients`` through together, then answer them after ``seconds`` of the clock.

    They are held together behind an opener's request (whose client is not expected back).
    """
    await gather.admit("opener")
    requests = [await held(gather, client) for client in clients]
    gather.answered("opener", is_expected_back=False)
    await asyncio.gather(*requests)
    clock.now += seconds
    for client in clients:
        gather.answered(client)


async def test_a_request_with_nothing_else_going_on_goes_at_once():
    gather = StepGather()
    await gather.admit("a")
    assert gather.stats.num_groups == 1 and gather.stats.num_held == 0


async def test_clients_stepping_together_go_as_one_group_once_all_are_back():
    """Requests that arrive while a group computes wait for it, and for its clients to come back."""
    clock = Clock()
    gather = StepGather(clock)
    await gather.admit("a")  # a's request computes
    b, c = await held(gather, "b"), await held(gather, "c")
    clock.now += LONG_S
    gather.answered("a")  # a got its answer and is expected back
    assert not b.done() and not c.done()
    a = asyncio.ensure_future(gather.admit("a"))
    await asyncio.gather(a, b, c)  # a came back: all three go together
    stats = gather.stats
    assert (stats.num_groups, stats.num_requests, stats.num_waits_given_up) == (2, 4, 0)


async def test_a_client_that_went_away_is_not_waited_for():
    clock = Clock()
    gather = StepGather(clock)
    await a_group_that_took(gather, clock, LONG_S, "a", "b")
    b = await held(gather, "b")
    gather.forget("a")
    await b
    assert gather.stats.num_waits_given_up == 0


async def test_a_client_that_does_not_come_back_is_waited_for_no_longer_than_a_group():
    clock = Clock()
    gather = StepGather(clock)
    await a_group_that_took(gather, clock, 0.0, "a", "b")  # a group that cost nothing
    b = await held(gather, "b")
    await b  # a is not back: b went without it
    assert gather.stats.num_waits_given_up == 1
    gather.answered("b", is_expected_back=False)
    await gather.admit("a")  # a, back later, goes at once: nothing computes, nobody is expected


async def test_a_new_client_waits_for_the_stepping_ones_as_long_as_their_groups_take():
    clock = Clock()
    gather = StepGather(clock)
    await a_group_that_took(gather, clock, LONG_S, "a", "b")
    newcomer = await held(gather, "c")
    for _ in range(10):  # a and b are waited for up to LONG_S: c stays held
        await asyncio.sleep(0)
    assert not newcomer.done()
    await asyncio.gather(gather.admit("a"), gather.admit("b"), newcomer)  # one group of three
    assert gather.stats.num_groups == 3 and gather.stats.num_waits_given_up == 0


async def a_group_of_returning_clients_that_took(
    gather: StepGather, clock: Clock, seconds: float, *clients: str
):
    """``clients``, all expected back, come back and go together; answered after ``seconds``."""
    await asyncio.gather(*(gather.admit(client) for client in clients))
    clock.now += seconds
    for client in clients:
        gather.answered(client)


async def test_a_cheap_group_after_a_long_one_does_not_cut_the_next_wait_short():
    """A group answered from cached rows takes no time; what a group takes stays the long
    one's, halved: a client not back yet is still waited for."""
    clock = Clock()
    gather = StepGather(clock)
    await a_group_that_took(gather, clock, LONG_S, "a", "b")
    await a_group_of_returning_clients_that_took(gather, clock, 0.0, "a", "b")
    b = await held(gather, "b")
    for _ in range(10):  # a is waited for up to LONG_S / 2
        await asyncio.sleep(0)
    assert not b.done()
    gather.forget("a")
    await b
    assert gather.stats.num_waits_given_up == 0


async def test_groups_that_got_cheaper_for_good_are_waited_for_less():
    clock = Clock()
    gather = StepGather(clock)
    await a_group_that_took(gather, clock, LONG_S, "a", "b")
    for _ in range(60):  # LONG_S halved 60 times: under a nanosecond
        await a_group_of_returning_clients_that_took(gather, clock, 0.0, "a", "b")
    b = await held(gather, "b")
    await b  # a is not back: b went without it
    assert gather.stats.num_waits_given_up == 1


async def test_clients_taking_turns_wait_for_each_other_no_longer_than_their_groups():
    """One client's answer is what the other waits for: each wait ends at the bound (0 here)."""
    clock = Clock()
    gather = StepGather(clock)
    for client in ("a", "b", "a", "b"):
        await gather.admit(client)
        gather.answered(client)
    assert gather.stats.num_groups == 4 and gather.stats.num_waits_given_up == 3


async def test_a_request_whose_client_is_not_expected_back_holds_nobody():
    clock = Clock()
    gather = StepGather(clock)
    await gather.admit("anonymous")
    b = await held(gather, "b")
    clock.now += LONG_S
    gather.answered("anonymous", is_expected_back=False)
    await b


async def test_a_client_answered_without_the_model_is_not_waited_for_until_it_is_answered_again():
    clock = Clock()
    gather = StepGather(clock)
    await a_group_that_took(gather, clock, LONG_S, "a", "b")  # both expected back
    b = await held(gather, "b")  # waits for a
    gather.answered_without_model("a")  # a came back, and its rows were all held
    await b
    clock.now += LONG_S
    gather.answered("b")  # b is expected back; a is not, until the model answers it again
    c = await held(gather, "c")  # waits for b alone
    b_again = asyncio.ensure_future(gather.admit("b"))
    await asyncio.gather(c, b_again)
    assert gather.stats.num_waits_given_up == 0


async def test_a_client_with_a_request_already_held_is_not_waited_for_again():
    clock = Clock()
    gather = StepGather(clock)
    await gather.admit("a")
    a_again, b = await held(gather, "a"), await held(gather, "b")
    clock.now += LONG_S
    gather.answered("a")  # a's next request is already here
    await asyncio.gather(a_again, b)


async def test_a_cancelled_held_request_leaves_no_trace():
    clock = Clock()
    gather = StepGather(clock)
    await gather.admit("a")
    b = await held(gather, "b")
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    assert gather.stats.num_held == 0
    clock.now += LONG_S
    gather.answered("a", is_expected_back=False)
    await gather.admit("c")  # nothing computes, nobody is expected: c goes at once
    assert gather.stats.num_requests == 2


async def test_a_request_cancelled_just_after_it_was_let_through_counts_as_answered():
    clock = Clock()
    gather = StepGather(clock)
    await gather.admit("a")
    b = await held(gather, "b")
    gather.answered("a", is_expected_back=False)  # b is let through ...
    b.cancel()  # ... and cancelled before it ran
    with pytest.raises(asyncio.CancelledError):
        await b
    await gather.admit("c")  # b neither computes nor is expected back: c goes at once
    assert gather.stats.num_groups == 3


STEPPING_CLIENT = """\
import asyncio, sys
from genlm_backend.serve import RemoteLM

lm = RemoteLM(sys.argv[1])
first, num_steps = int(sys.argv[2]), int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()


async def run():
    particles = [[first, p] for p in range(8)]
    for _ in range(num_steps):
        rows = await asyncio.gather(*map(lm.next_token_logprobs, particles))
        particles = [c + [int(row.argmax()) % 200] for c, row in zip(particles, rows)]
    return particles


print("done", asyncio.run(run()), flush=True)
"""


def test_clients_stepping_in_their_own_processes_share_one_batch_per_step():
    """3 client processes of 8 particles: each step is one batch of 24 rows (the first step
    may go in two: a client that arrives first goes alone, the others join it from then on)."""
    num_steps, num_clients = 4, 3
    server = ServerProcess.gated("--batch-s", "0.5")  # a forward pass that takes a while
    clients = []
    try:
        for first in range(1, 1 + num_clients):
            argv = ["-c", STEPPING_CLIENT, server.url, str(first), str(num_steps)]
            clients.append(ServerProcess(argv))
        for client in clients:
            client.wait_for("^ready$")
        with RemoteLM(server.url) as observer:
            before = observer.server_stats()[0].num_batches
            for client in clients:
                client.open_gate()  # "go"
            results = [ast.literal_eval(c.wait_for(r"^done (.*)$").group(1)) for c in clients]
            lm_stats, _ = observer.server_stats()
    finally:
        for client in clients:
            client.stop()
        server.stop()
    assert lm_stats.num_batches - before <= num_steps + 1
    reference = MockAsyncLM(byte_vocab=BYTE_VOCAB)
    for first, particles in enumerate(results, start=1):
        expected = [[first, p] for p in range(8)]
        for _ in range(num_steps):
            rows = reference.batch_next_token_logprobs_sync(expected)
            expected = [c + [int(row.argmax()) % 200] for c, row in zip(expected, rows)]
        assert particles == expected
