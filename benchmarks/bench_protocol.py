"""Encoding and decoding one ``/v1/logprobs`` request body: particles behind a shared prompt.

A client's batch of R contexts, each a P-token prompt plus its own 20
tokens (as SMC particles some steps in), validated tuples as the client
holds them. ``shared``: today's body, each context sent as the tokens it
adds to the one before it (``genlm_backend.llm.remote.protocol``); ``flat``: the
body before it (protocol 2), every context's every token as ``int32``,
decoded into lists. Encoding is the client's work per batch, decoding the
server's (on its event loop); in turns, median of ``--repeats``.

Usage::

    python benchmarks/bench_protocol.py
    python benchmarks/bench_protocol.py --shapes 4096x64 --repeats 50
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import msgpack
import numpy as np

from genlm_backend.llm.remote import protocol

LIMITS = protocol.ServeLimits(max_rows=256, max_body_bytes=64 << 20)


def flat_encode(contexts) -> bytes:
    lengths = [len(context) for context in contexts]
    ids = np.asarray([t for context in contexts for t in context], dtype="<i4").tobytes()
    fields = {"lengths": lengths, "ids": ids, "lora_names": [None] * len(contexts)}
    return msgpack.packb(fields, use_bin_type=True)


def flat_decode(body: bytes) -> list[list[int]]:
    fields = msgpack.unpackb(body, raw=False)
    flat = np.frombuffer(fields["ids"], dtype="<i4").tolist()
    offsets = np.cumsum([0, *fields["lengths"]]).tolist()
    return [flat[start:end] for start, end in itertools.pairwise(offsets)]


def shared_encode(contexts) -> bytes:
    return protocol.encode_logprobs_request(contexts, [None] * len(contexts))


def shared_decode(body: bytes) -> list[tuple[int, ...]]:
    return protocol.decode_logprobs_request(body, LIMITS).contexts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1024x16", "1024x64", "4096x64"])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(f"one request body, median of {args.repeats} (ms); PxR: P-token prompt, R contexts")
    print(
        "| shape | body KB, flat / shared | encode, flat | encode, shared | decode, flat | decode, shared | encode + decode, flat / shared |"
    )
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        prompt_tokens, rows = map(int, shape.split("x"))
        draw = random.Random(prompt_tokens * rows)
        prompt = [draw.randrange(128_000) for _ in range(prompt_tokens)]
        contexts = [
            tuple(prompt + [draw.randrange(128_000) for _ in range(20)]) for _ in range(rows)
        ]
        codecs = {"flat": (flat_encode, flat_decode), "shared": (shared_encode, shared_decode)}
        times = {(name, part): [] for name in codecs for part in ("encode", "decode")}
        sizes = {}
        for _ in range(args.repeats + 2):
            for name, (encode, decode) in codecs.items():
                started = time.perf_counter()
                body = encode(contexts)
                encoded = time.perf_counter()
                decoded = decode(body)
                times[name, "decode"].append(time.perf_counter() - encoded)
                times[name, "encode"].append(encoded - started)
                sizes[name] = len(body)
                assert [tuple(c) for c in decoded] == contexts
                del decoded  # freed here, outside the next codec's timing
        ms = {key: 1e3 * statistics.median(values[2:]) for key, values in times.items()}
        flat = ms["flat", "encode"] + ms["flat", "decode"]
        shared = ms["shared", "encode"] + ms["shared", "decode"]
        print(
            f"| {shape} | {sizes['flat'] / 1e3:.0f} / {sizes['shared'] / 1e3:.0f} "
            f"| {ms['flat', 'encode']:.2f} | {ms['shared', 'encode']:.2f} "
            f"| {ms['flat', 'decode']:.2f} | {ms['shared', 'decode']:.2f} "
            f"| {flat:.2f} / {shared:.2f} ({flat / shared:.1f}x) |"
        )


if __name__ == "__main__":
    main()
