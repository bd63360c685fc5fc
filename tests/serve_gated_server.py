"""A server for the fault tests: a mock model over 256 byte tokens whose batches wait for a gate.

Each batch prints ``batch started: N rows`` and then, with ``--gated``, waits
for one line on stdin (the test's ``open_gate``) before computing, so a test
can hold a batch in flight while it disconnects a client, kills or signals
the server. EOF on stdin opens the gate for good. A batch holding a context
that contains token 255 fails (a stand-in for a model error).
``--vocab-size`` makes another model (a prefix of the 256 byte tokens).
``--batch-s S`` makes every batch take S seconds, a stand-in for a forward pass
(the server's step gather times batches). ``--hello-timeout-s S`` gives a local
channel connection S seconds to name its session (a test that must tell "closed
at once" from "closed when the hello's time ran out" sets it past its own timeouts).
"""

from __future__ import annotations

import argparse
import sys
import time

from genlm_backend.llm.mock import MockAsyncLM, MockRunner
from genlm_backend.serve import ServeLimits, channel, serve
from genlm_backend.serve.server import main_log

BYTE_VOCAB = [bytes([i]) for i in range(256)]
FAILING_TOKEN = 255


class GatedRunner(MockRunner):
    def __init__(self, vocab_size, device, is_gated: bool, batch_s: float = 0.0):
        super().__init__(vocab_size, device)
        self.is_gated = is_gated
        self.batch_s = batch_s

    def run(self, requests):
        print(f"batch started: {len(requests)} rows", flush=True)
        if self.is_gated:
            sys.stdin.readline()
        time.sleep(self.batch_s)
        if any(FAILING_TOKEN in request.context for request in requests):
            raise RuntimeError("the model failed this batch")
        return super().run(requests)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--gated", action="store_true")
    parser.add_argument("--token", default=None)
    parser.add_argument("--max-rows", type=int, default=256)
    parser.add_argument("--max-context-length", type=int, default=None)
    parser.add_argument("--max-body-bytes", type=int, default=16 << 20)
    parser.add_argument("--vocab-size", type=int, default=len(BYTE_VOCAB))
    parser.add_argument("--batch-s", type=float, default=0.0)
    parser.add_argument("--hello-timeout-s", type=float, default=channel.HELLO_TIMEOUT_S)
    args = parser.parse_args()
    channel.HELLO_TIMEOUT_S = args.hello_timeout_s
    lm = MockAsyncLM(byte_vocab=BYTE_VOCAB[: args.vocab_size])
    lm.runner = GatedRunner(lm.vocab_size, lm.device, args.gated, args.batch_s)
    limits = ServeLimits(args.max_rows, args.max_context_length, args.max_body_bytes)
    log = main_log("gated server")
    serve(lm, port=args.port, limits=limits, token=args.token, backend="mock", log=log)
    log("stopped")


if __name__ == "__main__":
    main()
