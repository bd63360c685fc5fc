"""The ASGI plumbing of :class:`~genlm_backend.serve.app.ServeApp`: bodies in, answers out.

Two exceptions carry a request's fate to the app's one answering place:
:class:`Reject` (an error answer) and :class:`ClientGone` (nobody to answer).
"""

from __future__ import annotations

from genlm_backend.llm.remote import protocol

SEND_CHUNK_BYTES = 1 << 20
"""Answers are sent in slices of this size (see :func:`send_answer`)."""


class ClientGone(Exception):
    """The client disconnected before its answer."""


class Reject(Exception):
    """An error answer of ``kind`` (a key of :data:`protocol.ERROR_STATUS`)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


async def read_body(scope, receive, max_bytes: int) -> bytes:
    """The whole request body, refused past ``max_bytes`` (by its announced length when it has one)."""
    announced = dict(scope["headers"]).get(b"content-length")
    if announced is not None and announced.isdigit() and int(announced) > max_bytes:
        raise Reject("RequestTooLarge", too_large_message(int(announced), max_bytes))
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise Reject("RequestTooLarge", too_large_message(size, max_bytes))
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def too_large_message(num_bytes: int, max_bytes: int) -> str:
    """Why a request of ``num_bytes`` was refused."""
    return f"a request body of {num_bytes} bytes; this server takes at most {max_bytes}"


async def wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_answer(send, status: int, body: bytes, content_type: str, model_id: bytes) -> None:
    headers = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(body)).encode()),
        (protocol.MODEL_ID_HEADER.encode(), model_id),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    # In slices: asyncio's socket transport (Python 3.11) shifts its whole buffer after
    # each partial write, so one 12 MB write costs several times what 1 MB slices do.
    view = memoryview(body)
    for start in range(0, max(len(body), 1), SEND_CHUNK_BYTES):
        more_body = start + SEND_CHUNK_BYTES < len(body)
        chunk = bytes(view[start : start + SEND_CHUNK_BYTES])
        await send({"type": "http.response.body", "body": chunk, "more_body": more_body})


async def send_open_answer(send, body: bytes, content_type: str, model_id: bytes) -> None:
    """Start a 200 answer that stays open: its headers, then ``body`` as its first chunk."""
    headers = [
        (b"content-type", content_type.encode()),
        (protocol.MODEL_ID_HEADER.encode(), model_id),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def end_open_answer(send) -> None:
    await send({"type": "http.response.body", "body": b"", "more_body": False})
