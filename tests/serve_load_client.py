"""A client process of the load-with-faults test (``tests/stress/test_serve_load.py``).

``serve_load_client.py URL SEED CALLS_1 CALLS_2`` connects a ``RemoteLM``, then:

1. puts ``CALLS_1`` calls in flight at once, cancels a random fifth of them,
   prints ``launched``, and waits for all; prints
   ``phase 1: answered A cancelled C failed F``;
2. waits for a line on stdin (the test restarts the server meanwhile), then does
   the same with ``CALLS_2`` calls and prints ``phase 2: ...``.

Every answered row is checked against an in-process ``MockAsyncLM`` bit for bit
(a wrong row ends the process with status 3); a failure must be a
``ServerUnavailableError`` (anything else ends it with status 4).
"""

from __future__ import annotations

import asyncio
import random
import sys

import torch

from genlm_backend import MockAsyncLM
from genlm_backend.errors import ServerUnavailableError
from genlm_backend.llm.remote import RemoteLM
from tests.serve_gated_server import BYTE_VOCAB, FAILING_TOKEN


async def phase(
    lm: RemoteLM, reference: MockAsyncLM, rng: random.Random, num_calls: int, name: str
):
    contexts = [
        [rng.randrange(FAILING_TOKEN) for _ in range(rng.randint(1, 6))] for _ in range(num_calls)
    ]
    tasks = [asyncio.ensure_future(lm.next_token_logprobs(context)) for context in contexts]
    await asyncio.sleep(0)  # every call queued (no clock: one turn of the loop)
    for task in rng.sample(tasks, num_calls // 5):
        task.cancel()
    print("launched", flush=True)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    answered = cancelled = failed = 0
    for context, outcome in zip(contexts, outcomes):
        if isinstance(outcome, asyncio.CancelledError):
            cancelled += 1
        elif isinstance(outcome, ServerUnavailableError):
            failed += 1
        elif isinstance(outcome, BaseException):
            print(f"unexpected error: {type(outcome).__name__}: {outcome}", flush=True)
            sys.exit(4)
        elif not torch.equal(outcome, await reference.next_token_logprobs(context)):
            print(f"wrong row for {context}", flush=True)
            sys.exit(3)
        else:
            answered += 1
    print(f"{name}: answered {answered} cancelled {cancelled} failed {failed}", flush=True)


async def main() -> None:
    url, seed, calls_1, calls_2 = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:5])
    rng = random.Random(seed)
    reference = MockAsyncLM(byte_vocab=BYTE_VOCAB)
    with RemoteLM(url) as lm:
        await phase(lm, reference, rng, calls_1, "phase 1")
        await asyncio.to_thread(sys.stdin.readline)
        await phase(lm, reference, rng, calls_2, "phase 2")


if __name__ == "__main__":
    asyncio.run(main())
