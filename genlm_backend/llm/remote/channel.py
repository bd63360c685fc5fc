"""A slab session's local channel: ``/v1/logprobs`` round trips without HTTP, for clients on the server's machine.

The frames and the client's side; the server listens and answers in
:mod:`~genlm_backend.serve.channel`.

A client whose slab the server mapped gets, in the session's accepted
answer, the address of the server's local socket (a Unix-domain socket: a
Linux abstract name, which leaves nothing in the file system, or a path in
a private directory elsewhere). It connects once and names its session in a
first frame; from then on each batch is one frame each way on that
connection, the request's body as for ``POST /v1/logprobs`` and its answer:

    frame   := length (uint32, little-endian) payload
    hello   := frame(msgpack {"session": str})  ->  frame(b"O") | frame(b"E" + error map)
    request := frame(logprobs request body)     ->  frame(answer)
    answer  := b"S" + msgpack {"num_rows": int}   rows in the session's slab
             | b"R" + float32 rows                  rows here (they did not fit the slab)
             | b"E" + msgpack {"kind", "message"}   this request failed; the channel stays open

Knowing the session's id (random, given only to the client that offered
the slab, with its token when the server asks for one) is what lets a
connection in. A request over the channel has the same limits, errors,
cancellation and shutdown as one over HTTP: the client closing the
connection (or dying) cancels its request; a shutdown answers
``ShuttingDown`` and closes every channel. The session's lifetime is still
its HTTP answer's (:mod:`~genlm_backend.serve.sessions`): a channel whose
session ended answers with rows in frames.

Why: a loopback HTTP exchange (urllib3, uvicorn, ASGI) costs each side of a
round trip far more than a frame on a socket does, and a held batch's whole
round trip is only a few of those exchanges long (BENCHMARKS.md, "Serving").
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

import msgpack

from genlm_backend.errors import ServerUnavailableError
from genlm_backend.llm.remote import protocol

LENGTH_BYTES = 4
HAS_UNIX_SOCKETS = hasattr(socket, "AF_UNIX")

SLAB_ANSWER = b"S"
ROWS_ANSWER = b"R"
ERROR_ANSWER = b"E"
HELLO_ACCEPTED = b"O"
HELLO_TIMEOUT_S = 10.0
"""A connection that has not named its session by then is closed."""
MAX_HELLO_BYTES = 1024
"""A hello is a session id in a small map; a connection that announces more is closed unread."""


def frame(payload: bytes) -> bytes:
    """``payload`` with its length before it, as it goes on the channel."""
    return len(payload).to_bytes(LENGTH_BYTES, "little") + payload


class ChannelRefused(Exception):
    """A client cannot use the server's local channel (the message says why); HTTP stays."""


class ChannelClient:
    """One client's connection to its server's local channel, bound to its slab session.

    Used by one thread at a time (the client's ``RemoteRunner``, under its
    ``AsyncLM``'s compute lock); a lock makes other use wait, not interleave.

    Args:
        address: The server's channel address (from the session's accepted answer).
        session: The session this channel writes into.
        url: The server's URL, for messages.
        read_timeout_s: Most seconds to wait for an answer.
    """

    def __init__(self, address: str, session: str, url: str, read_timeout_s: float):
        self.url = url
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(read_timeout_s)
            self._sock.connect(address)
            answer = self._exchange(protocol.pack({"session": session}))
        except (OSError, ServerUnavailableError) as exc:
            self._sock.close()
            raise ChannelRefused(f"cannot use the server's local channel ({exc})") from None
        if answer[:1] != HELLO_ACCEPTED:
            self._sock.close()
            raise ChannelRefused(f"the server refused its local channel: {_message(answer)}")

    def call(self, body: bytes) -> tuple[bytes, memoryview]:
        """One request's answer: its kind (:data:`SLAB_ANSWER`, :data:`ROWS_ANSWER`,
        :data:`ERROR_ANSWER`) and payload.

        Raises:
            ServerUnavailableError: the server closed the channel, or gave no answer in
                time; the channel is closed then.
        """
        with self._lock:
            answer = self._exchange(body)
        return bytes(answer[:1]), answer[1:]

    def _exchange(self, payload: bytes) -> memoryview:
        try:
            self._sock.sendall(frame(payload))
            length = int.from_bytes(self._receive(LENGTH_BYTES), "little")
            return self._receive(length)
        except TimeoutError:
            self.close()
            raise ServerUnavailableError(
                f"the server at {self.url} gave no answer in time (its local channel); "
                "the next call tries again"
            ) from None
        except (OSError, EOFError) as exc:
            self.close()
            raise ServerUnavailableError(
                f"the server at {self.url} closed its local channel during the request "
                f"({type(exc).__name__}): it stopped or crashed. The next call reconnects"
            ) from None

    def _receive(self, num_bytes: int) -> memoryview:
        buffer = bytearray(num_bytes)
        view, received = memoryview(buffer), 0
        while received < num_bytes:
            count = self._sock.recv_into(view[received:])
            if count == 0:
                raise EOFError("the connection closed")
            received += count
        return view

    def is_dropped(self) -> bool:
        """Whether the server closed this idle channel (it stopped, or restarted): readable
        between requests means closed, as for a kept-alive HTTP connection."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):  # closed here
            return True
        return bool(readable)

    def close(self) -> None:
        """Close the connection (the server cancels a request in flight). Idempotent.

        From another thread too: a call waiting for its answer there ends at once,
        with ``ServerUnavailableError``.
        """
        with contextlib.suppress(OSError):  # not connected, or already closed
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _message(answer: memoryview) -> str:
    try:
        return str(msgpack.unpackb(answer[1:])["message"])
    except Exception:  # noqa: BLE001 - any malformed answer is reported as such
        return f"an unreadable answer ({answer[:40]!r})"
