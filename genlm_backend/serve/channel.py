"""The server's side of a slab session's local channel (the frames are :mod:`~genlm_backend.llm.remote.channel`'s).

From a server's first slab session on, it listens on a local socket
(:class:`ChannelListener`) whose address it gives in each session's accepted
answer. :class:`ChannelServer` serves each connection: its hello names an open
session, then each request frame gets one answer frame, computed by the same
server function as a ``POST /v1/logprobs`` (``answer_logprobs``), with the same
limits, errors, cancellation (the client closing the connection) and
shutdown answers.

Only the server's own user may connect: on Linux the socket's name is abstract
(no file permissions), so the peer's credentials are checked; elsewhere the
socket lies in a directory only that user may enter. A hello is at most
:data:`~genlm_backend.llm.remote.channel.MAX_HELLO_BYTES` and comes within
:data:`~genlm_backend.llm.remote.channel.HELLO_TIMEOUT_S`; a request may name only
its hello's session; at most :attr:`ChannelServer.max_connections` connections
are served at once, and one more is answered "busy".
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import struct
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import Protocol

from genlm_backend.llm.remote import protocol
from genlm_backend.llm.remote.channel import (
    ERROR_ANSWER,
    HAS_UNIX_SOCKETS,
    HELLO_ACCEPTED,
    HELLO_TIMEOUT_S,
    LENGTH_BYTES,
    MAX_HELLO_BYTES,
    ROWS_ANSWER,
    SLAB_ANSWER,
    frame,
)
from genlm_backend.serve.asgi import ClientGone, Reject, too_large_message
from genlm_backend.serve.sessions import SlabSessions


class ChannelHost(Protocol):
    """What a :class:`ChannelServer` uses of its server (:class:`~genlm_backend.serve.app.ServeApp`)."""

    sessions: SlabSessions
    closing: asyncio.Event
    in_flight: set[asyncio.Task]
    held_sessions: set[asyncio.Task]

    @property
    def max_body_bytes(self) -> int: ...

    def closing_watch(self) -> asyncio.Future: ...

    def shutdown_message(self) -> str: ...

    def count_rejected(self, reject: Reject) -> None: ...

    def log(self, line: str) -> None: ...

    async def answer_logprobs(
        self, body: bytes, gone: Callable[[], Awaitable], who: str, session: str | None = None
    ) -> tuple[bytes, str]: ...


class ChannelServer:
    """Listens from the first slab session on, and serves each channel connection.

    Args:
        host: The server whose requests the channel carries.
        max_connections: Most connections served at once.
    """

    def __init__(self, host: ChannelHost, max_connections: int = 256):
        self.host = host
        self.max_connections = max_connections
        self.num_connections = 0
        self._listener: asyncio.Future[ChannelListener] | None = None
        self._refusal: str | None = None

    async def address(self) -> str:
        """The local channel's address, listening from the first call on (``""``: none here)."""
        if self._listener is None:
            self._listener = asyncio.ensure_future(ChannelListener.start(self.serve_connection))
        try:
            listener = await asyncio.shield(self._listener)
        except Exception as exc:  # noqa: BLE001 - e.g. no Unix sockets on this platform
            if self._refusal is None:
                self._refusal = str(exc)
                self.host.log(f"no local channel ({exc}): clients on this machine use HTTP")
            return ""
        return "" if self.host.closing.is_set() else listener.address

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """One client's channel connection: its hello, then one answer per request frame."""
        host = self.host
        task = asyncio.current_task()
        assert task is not None
        host.held_sessions.add(task)
        self.num_connections += 1
        try:
            refusal = self._refusal_of(writer)
            if refusal is not None:
                writer.write(frame(self._error(refusal)))
                await writer.drain()
                return
            try:
                hello = await asyncio.wait_for(
                    self._next_frame(reader, MAX_HELLO_BYTES), HELLO_TIMEOUT_S
                )
            except TimeoutError:
                return  # a connection that never named its session
            if hello is None:
                return
            session, who = self._session_of(hello)
            if session is None:
                writer.write(frame(ERROR_ANSWER + protocol.error_body("Unauthorized", who)))
                await writer.drain()
                return
            writer.write(frame(HELLO_ACCEPTED))
            while True:
                try:
                    body = await self._next_frame(reader)
                except FrameTooLarge as exc:
                    message = too_large_message(exc.num_bytes, host.max_body_bytes)
                    writer.write(frame(self._error(Reject("RequestTooLarge", message))))
                    continue
                if body is None:
                    return
                host.in_flight.add(task)
                try:
                    answer = await self._answer(body, reader, who, session)
                finally:
                    host.in_flight.discard(task)
                if answer is None:
                    return
                writer.write(frame(answer))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, FrameTooLarge):
            pass  # the client went away between requests, or sent an oversized hello
        finally:
            self.num_connections -= 1
            host.held_sessions.discard(task)
            writer.close()

    def _refusal_of(self, writer: asyncio.StreamWriter) -> Reject | None:
        """Why a new connection is not served (another user, too many connections), if it is not."""
        peer_uid = _peer_uid(writer.get_extra_info("socket"))
        if peer_uid is not None and peer_uid != os.geteuid():
            return Reject("Unauthorized", "this server's local channel serves its own user only")
        if self.num_connections > self.max_connections:
            return Reject(
                "Busy",
                f"the server serves {self.max_connections} local connections at most; retry later",
            )
        return None

    async def _next_frame(
        self, reader: asyncio.StreamReader, max_bytes: int | None = None
    ) -> bytes | None:
        """The next frame, ``None`` once the client closed or the server is closing.

        ``max_bytes`` (a hello's): a longer frame raises ``FrameTooLarge`` unread.
        """
        if max_bytes is None:
            read = asyncio.ensure_future(read_frame(reader, self.host.max_body_bytes))
        else:
            read = asyncio.ensure_future(read_frame(reader, max_bytes, drain=False))
        try:
            await asyncio.wait(
                {read, self.host.closing_watch()}, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:  # cancelled: the hello's time is up, or the handler's end
            read.cancel()
            raise
        if not read.done():  # closing
            read.cancel()
            return None
        return read.result()

    def _session_of(self, hello: bytes) -> tuple[str | None, str]:
        """The open session a hello names, and the client's name for the log; else ``None``
        and why."""
        try:
            session = protocol.unpack(hello).get("session")
        except ValueError as exc:
            return None, f"a malformed hello ({exc})"
        client = self.host.sessions.client_of(session) if isinstance(session, str) else None
        if client is None:
            return None, "the hello names no open session of this server"
        return session, f"client {client[:12]} (local channel)"

    async def _answer(
        self, body: bytes, reader: asyncio.StreamReader, who: str, session: str
    ) -> bytes | None:
        """A request frame's answer frame; ``None``: the client went away."""
        host = self.host
        try:
            if host.closing.is_set():
                raise Reject("ShuttingDown", host.shutdown_message())
            rows, content_type = await host.answer_logprobs(
                body, lambda: reader.read(1), who, session
            )
        except Reject as reject:
            return self._error(reject)
        except ClientGone:
            return None
        kind = SLAB_ANSWER if content_type == protocol.SLAB_CONTENT_TYPE else ROWS_ANSWER
        return kind + rows

    def _error(self, reject: Reject) -> bytes:
        self.host.count_rejected(reject)
        return ERROR_ANSWER + protocol.error_body(reject.kind, str(reject))

    def close(self) -> None:
        """Stop listening (connections end with their handlers). Idempotent."""
        listener = self._listener
        if listener is None or not listener.done() or listener.cancelled() or listener.exception():
            return  # never listened
        listener.result().close()


class ChannelListener:
    """The server's local socket; each connection is served by ``serve_connection(reader, writer)``."""

    def __init__(self, server: asyncio.AbstractServer, address: str, directory: str | None):
        self._server = server
        self.address = address
        """What a client connects to: a path, or an abstract name starting with ``"\\0"``."""
        self._directory = directory

    @classmethod
    async def start(cls, serve_connection) -> ChannelListener:
        """Listen on a new local socket only this server knows the address of.

        Raises:
            OSError: no Unix-domain sockets here, or the socket could not be made.
        """
        if not HAS_UNIX_SOCKETS:
            raise OSError("no Unix-domain sockets on this platform")
        directory = None
        if sys.platform.startswith("linux"):
            address = "\0genlm-serve-" + secrets.token_hex(16)
        else:
            directory = tempfile.mkdtemp(prefix="genlm-serve-")  # mode 0700: this user only
            address = os.path.join(directory, "channel")
        try:
            server = await asyncio.start_unix_server(serve_connection, address)
        except BaseException:
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
            raise
        return cls(server, address, directory)

    def close(self) -> None:
        """Stop listening (connections open stay until their handlers end). Idempotent."""
        self._server.close()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int, drain: bool = True
) -> bytes | None:
    """The next frame's payload; ``None`` once the client has closed the connection.

    Raises:
        FrameTooLarge: the frame announces more than ``max_bytes`` (with ``drain``, its
            payload is read and dropped first, so the connection stays usable; without,
            nothing more is read).
        asyncio.IncompleteReadError: the connection closed mid-frame.
    """
    try:
        header = await reader.readexactly(LENGTH_BYTES)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    length = int.from_bytes(header, "little")
    if length > max_bytes and not drain:
        raise FrameTooLarge(length)
    if length > max_bytes:
        remaining = length
        while remaining:
            remaining -= len(await reader.readexactly(min(remaining, 1 << 20)))
        raise FrameTooLarge(length)
    return await reader.readexactly(length)


class FrameTooLarge(Exception):
    """A frame over the server's ``max_body_bytes`` (read and dropped; the channel stays usable)."""

    def __init__(self, num_bytes: int):
        super().__init__(num_bytes)
        self.num_bytes = num_bytes


_PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _peer_uid(sock: socket.socket | None) -> int | None:
    """The user id of a Unix socket's peer, where the platform says (``SO_PEERCRED``: Linux)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if sock is None or option is None:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, option, _PEER_CREDENTIALS.size)
    return _PEER_CREDENTIALS.unpack(raw)[1]
