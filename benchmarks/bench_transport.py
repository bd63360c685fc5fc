"""Which transport for ``genlm-backend serve``: round-trip time of a batch of float32 rows.

Each candidate is a server process answering a small msgpack request
``{"rows": n}`` with ``n x vocab`` float32 rows as raw bytes (what a
``/v1/logprobs`` answer is), and a synchronous client in this process. No
model runs: this is the transport's own cost per round trip. Candidates are
interleaved (one round trip each, in turn) so that the machine's load hits
them alike; warm-up excluded; the median of ``--repeats`` is reported.

* **shipped**: uvicorn (httptools parser), answer sent in 1 MiB slices, urllib3 client;
* **httpx client**: the same server, httpx client (if installed);
* **one-piece answer**: the answer sent in one ASGI message;
* **h11 parser**: uvicorn's pure-Python parser;
* **zmq**: ZeroMQ REQ/REP (pyzmq), the rows as one frame (if installed);
* **shared memory**: the shipped server and client, the rows written into the
  client's slab (``genlm_backend.llm.remote.slab``, one copy) and copied out of it
  into a fresh array (one copy); the answer says how many rows.

Every candidate's client ends with the rows in memory it owns (the HTTP and
ZeroMQ answers' bytes, or the copy out of the slab).

    python benchmarks/bench_transport.py [--rows 1 16 64] [--vocab 49152] [--repeats 30]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's genlm_backend

SLICE_BYTES = 1 << 20


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_accepting(port: int, timeout_s: float = 60.0) -> None:
    """Return once something accepts connections on ``port`` (a server just started)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def http_server(port: int, vocab: int, parser: str, slice_bytes: int) -> None:
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        rows = bytes(4 * msgpack.unpackb(body)["rows"] * vocab)
        headers = [(b"content-length", str(len(rows)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for start in range(0, len(rows), slice_bytes):
            more = start + slice_bytes < len(rows)
            chunk = rows[start : start + slice_bytes]
            await send({"type": "http.response.body", "body": chunk, "more_body": more})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="off", http=parser)


def slab_server(port: int, vocab: int) -> None:
    """Answers ``{"rows": n, "name", "nonce", "capacity"}`` by writing n rows into that slab."""
    import torch
    import uvicorn

    from genlm_backend.llm.remote.slab import Slab

    slabs: dict[str, Slab] = {}
    rows = torch.zeros(0, vocab)

    async def app(scope, receive, send):
        nonlocal rows
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = msgpack.unpackb(body)
        name = request["name"]
        if name not in slabs:
            slabs[name] = Slab.attach(name, request["nonce"], request["capacity"], vocab)
        if rows.shape[0] < request["rows"]:
            rows = torch.zeros(request["rows"], vocab)
        slabs[name].write(rows[: request["rows"]])
        answer = msgpack.packb({"num_rows": request["rows"]})
        headers = [(b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")


def slab_client(port: int, vocab: int, capacity: int) -> Callable[[int], int]:
    import urllib3

    from genlm_backend.llm.remote.slab import Slab

    pool = urllib3.HTTPConnectionPool("127.0.0.1", port, retries=False)
    slab = Slab.create(capacity, vocab)
    fields = {"name": slab.name, "nonce": slab.nonce, "capacity": capacity}

    def round_trip(rows: int) -> int:
        body = msgpack.packb({"rows": rows, **fields})
        answer = msgpack.unpackb(pool.request("POST", "/", body=body).data)
        slab.unlink()  # mapped by the server from the first answer on
        return 4 * vocab * slab.read(answer["num_rows"]).shape[0]

    return round_trip


def zmq_server(port: int, vocab: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.REP)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while True:
        request = msgpack.unpackb(sock.recv())
        sock.send(bytes(4 * request["rows"] * vocab), copy=False)


def urllib3_client(port: int) -> Callable[[int], int]:
    import urllib3

    pool = urllib3.HTTPConnectionPool("127.0.0.1", port, retries=False)
    return lambda rows: len(pool.request("POST", "/", body=msgpack.packb({"rows": rows})).data)


def httpx_client(port: int) -> Callable[[int], int]:
    import httpx

    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", transport=httpx.HTTPTransport(retries=100)
    )
    return lambda rows: len(client.post("/", content=msgpack.packb({"rows": rows})).content)


def zmq_client(port: int) -> Callable[[int], int]:
    import zmq

    sock = zmq.Context().socket(zmq.REQ)
    sock.connect(f"tcp://127.0.0.1:{port}")

    def round_trip(rows: int) -> int:
        sock.send(msgpack.packb({"rows": rows}))
        return len(sock.recv(copy=False).buffer)

    return round_trip


def candidates() -> dict[str, tuple[Callable, tuple, Callable]]:
    """name -> (server function, its extra arguments, client factory)."""
    found: dict[str, tuple[Callable, tuple, Callable]] = {
        "shipped": (http_server, ("httptools", SLICE_BYTES), urllib3_client),
        "httpx client": (http_server, ("httptools", SLICE_BYTES), httpx_client),
        "one-piece answer": (http_server, ("httptools", 1 << 40), urllib3_client),
        "h11 parser": (http_server, ("h11", SLICE_BYTES), urllib3_client),
        "zmq": (zmq_server, (), zmq_client),
        "shared memory": (slab_server, (), slab_client),
    }
    missing = {"httpx client": "httpx", "zmq": "zmq"}
    return {
        name: candidate
        for name, candidate in found.items()
        if name not in missing or importlib.util.find_spec(missing[name]) is not None
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    processes, clients = [], {}
    for name, (server, extra, client) in candidates().items():
        port = free_port()
        process = spawn.Process(target=server, args=(port, args.vocab, *extra), daemon=True)
        process.start()
        processes.append(process)
        wait_accepting(port)
        if client is slab_client:
            clients[name] = slab_client(port, args.vocab, max(args.rows))
        else:
            clients[name] = client(port)
    try:
        times: dict[tuple[str, int], list[float]] = {}
        for rows in args.rows:
            for repeat in range(5 + args.repeats):
                for name, round_trip in clients.items():
                    start = time.perf_counter()
                    if round_trip(rows) != 4 * rows * args.vocab:
                        raise RuntimeError(f"{name}: wrong answer length")
                    if repeat >= 5:  # warm-up excluded
                        times.setdefault((name, rows), []).append(time.perf_counter() - start)
    finally:
        for process in processes:
            process.terminate()
            process.join()
    print(f"vocabulary {args.vocab}, float32 rows, ms per round trip, median of {args.repeats}")
    print("| rows | MB per answer | " + " | ".join(clients) + " |")
    print("|---|---|" + "---|" * len(clients))
    for rows in args.rows:
        cells = [f"{1e3 * statistics.median(times[name, rows]):.2f}" for name in clients]
        print(f"| {rows} | {4 * rows * args.vocab / 1e6:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
