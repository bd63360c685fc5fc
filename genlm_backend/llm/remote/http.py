"""One HTTP request from a client to its server, its failures as the library's exceptions."""

from __future__ import annotations

import urllib3

from genlm_backend.errors import (
    RemoteModelError,
    RequestTooLargeError,
    ServerRejectedError,
    ServerUnavailableError,
)
from genlm_backend.llm.remote import protocol

_ERRORS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "RequestTooLarge": RequestTooLargeError,
    "Unauthorized": ServerRejectedError,
    "Forbidden": PermissionError,
    "ShuttingDown": ServerUnavailableError,
    "Busy": ServerUnavailableError,
    "ModelError": RemoteModelError,
}


def send(
    pool: urllib3.HTTPConnectionPool,
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    preload_content: bool = True,
) -> urllib3.BaseHTTPResponse:
    """One request on ``pool`` (to the server at ``url``); its answer, whatever its status.

    Raises:
        ServerUnavailableError: unreachable, gone mid-request, no answer in time.
    """
    try:
        return pool.request(method, path, body=body, preload_content=preload_content)
    except urllib3.exceptions.NewConnectionError as exc:  # before TimeoutError: a subclass
        raise ServerUnavailableError(
            f"cannot reach the genlm-backend server at {url} ({exc.__class__.__name__}); "
            "is `genlm-backend serve` running there? The next call tries again"
        ) from None
    except urllib3.exceptions.TimeoutError as exc:
        raise ServerUnavailableError(
            f"the server at {url} gave no answer in time ({type(exc).__name__}); "
            "the next call tries again"
        ) from None
    except urllib3.exceptions.HTTPError as exc:
        raise ServerUnavailableError(
            f"the server at {url} closed the connection during the request "
            f"({type(exc).__name__}): it stopped or crashed. The next call reconnects"
        ) from None


def error_of(response: urllib3.BaseHTTPResponse, url: str) -> Exception:
    """The exception a non-200 answer stands for (its ``kind``), with the server's message."""
    return error_of_fields(response.data, url, f"HTTP {response.status}")


def error_of_fields(body: bytes | memoryview, url: str, via: str) -> Exception:
    """The exception an error answer's ``{"kind", "message"}`` ``body`` stands for; ``via``
    says how it came (``HTTP 400``, ``its local channel``)."""
    try:
        fields = protocol.unpack(body)
        kind, message = str(fields["kind"]), str(fields["message"])
    except (ValueError, KeyError):
        kind, message = "", bytes(body[:200]).decode(errors="replace")
    error_type = _ERRORS.get(kind, ServerUnavailableError)
    return error_type(f"{message} (server {url}, {via})")
