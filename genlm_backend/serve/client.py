"""The client side: :class:`RemoteRunner` (one HTTP round trip per batch) and :class:`RemoteLM`.

``RemoteLM`` is an ordinary :class:`~genlm_backend.llm.base.AsyncLM` whose
runner is a server. Validation, the output cache, the auto-batcher, the sync
bridge and sampling are the in-process ones, so concurrent awaits in one
client become one batch, and that batch is one POST::

    await next_token_logprobs(ids) -> validate -> output cache -> AutoBatcher
        -> worker thread: RemoteRunner.run(requests) -> POST /v1/logprobs -> float32 bytes
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import urllib3

from genlm_backend.errors import (
    RemoteModelError,
    RequestTooLargeError,
    ServerModelChangedError,
    ServerRejectedError,
    ServerUnavailableError,
)
from genlm_backend.llm.base import DEFAULT_OUTPUT_CACHE_BYTES, AsyncLM
from genlm_backend.llm.runner import Adapter, Request, RunnerStats, ScoreRequest, score_from_rows
from genlm_backend.llm.stats import LMStats
from genlm_backend.serve import protocol
from genlm_backend.serve.app import ServeStats
from genlm_backend.serve.info import byte_vocab_of, load_tokenizer
from genlm_backend.serve.server import TOKEN_ENV

REMOTE_SCHEME = "genlm://"
"""Model names starting with this are servers: ``load_model_by_name("genlm://127.0.0.1:8765")``."""

_ERRORS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "RequestTooLarge": RequestTooLargeError,
    "Unauthorized": ServerRejectedError,
    "ShuttingDown": ServerUnavailableError,
    "ModelError": RemoteModelError,
}


class RemoteRunner:
    """A :class:`~genlm_backend.llm.runner.Runner` whose model is a ``genlm-backend serve`` server.

    Synchronous (it runs in the ``AsyncLM``'s worker thread or a ``*_sync``
    caller's thread); each call is one HTTP request (urllib3) on a kept-alive
    connection, reopened on the next call after a failure. Nothing is retried.

    Args:
        url: ``http://HOST:PORT`` of the server.
        token: Shared token (``None``: ``$GENLM_SERVE_TOKEN`` if set).
        connect_timeout_s: Most seconds to open a connection.
        read_timeout_s: Most seconds to wait for an answer (a batch queued behind
            other clients' batches counts too).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 300.0,
    ):
        self.url = url.rstrip("/")
        token = os.environ.get(TOKEN_ENV) if token is None else token
        headers = {protocol.TOKEN_HEADER: f"Bearer {token}"} if token else {}
        self._http = urllib3.connection_from_url(
            self.url,
            headers=headers,
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
            retries=False,  # a failure is reported, not hidden; the next call reconnects
            maxsize=2,  # the model's worker thread, and a caller's thread for stats or LoRA
        )
        self.model_id: str | None = None
        self.vocab_size = 0
        self.num_round_trips = 0
        self._num_tokens_sent = 0

    @property
    def stats(self) -> RunnerStats:
        return RunnerStats(num_tokens_computed=self._num_tokens_sent, kv_cache_bytes=0)

    def request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget: its context length."""
        return len(request.context)

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Scores gathered from the rows of each continuation's prefixes."""
        return score_from_rows(self.run, requests)

    def fetch_info(self) -> dict:
        """The server's ``/v1/info`` map; remembers its model id (checked on every later answer)."""
        info = protocol.unpack(self._call("GET", "/v1/info").data)
        if info.get("protocol") != protocol.PROTOCOL_VERSION:
            raise ServerUnavailableError(
                f"the server at {self.url} speaks protocol {info.get('protocol')!r}, "
                f"this client {protocol.PROTOCOL_VERSION}: upgrade the older of the two"
            )
        self.model_id = info["model_id"]
        self.vocab_size = len(info["byte_vocab"])
        return info

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        return self._logprobs(requests, uncached=False)

    def run_uncached(self, request: Request) -> torch.Tensor:
        return self._logprobs([request], uncached=True)[0]

    def _logprobs(self, requests: Sequence[Request], uncached: bool) -> torch.Tensor:
        contexts = [request.context for request in requests]
        names = [None if r.adapter is None else r.adapter.name for r in requests]
        body = protocol.encode_logprobs_request(contexts, names, uncached)
        response = self._call("POST", "/v1/logprobs", body)
        self._num_tokens_sent += sum(map(len, contexts))
        return protocol.decode_rows(response.data, len(requests), self.vocab_size)

    def load_adapter(self, adapter: Adapter) -> None:
        self._call("POST", "/v1/lora", protocol.pack({"op": "add", **_adapter_fields(adapter)}))

    def unload_adapter(self, adapter: Adapter) -> None:
        self._call("POST", "/v1/lora", protocol.pack({"op": "remove", "name": adapter.name}))

    def clear(self) -> None:
        """Drop the server's keys/values and cached rows (every client's: only speed changes)."""
        self.clear_server("all")

    def clear_server(self, what: str) -> None:
        self._call("POST", "/v1/clear", protocol.pack({"what": what}))

    def server_stats(self) -> dict:
        return protocol.unpack(self._call("GET", "/v1/stats").data)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: bytes | None = None) -> urllib3.BaseHTTPResponse:
        """One request; its failure as the library's exception.

        Raises:
            ServerUnavailableError: unreachable, gone mid-request, no answer in time, shutting down.
            ServerModelChangedError: the server now holds another model.
            ServerRejectedError, RequestTooLargeError, RemoteModelError, TypeError, ValueError:
                the server's answer for this request.
        """
        try:
            response = self._http.request(method, path, body=body)
        except urllib3.exceptions.NewConnectionError as exc:  # before TimeoutError: a subclass
            raise ServerUnavailableError(
                f"cannot reach the genlm-backend server at {self.url} ({exc.__class__.__name__}); "
                "is `genlm-backend serve` running there? The next call tries again"
            ) from None
        except urllib3.exceptions.TimeoutError as exc:
            raise ServerUnavailableError(
                f"the server at {self.url} gave no answer in time ({type(exc).__name__}); "
                "the next call tries again"
            ) from None
        except urllib3.exceptions.HTTPError as exc:
            raise ServerUnavailableError(
                f"the server at {self.url} closed the connection during the request "
                f"({type(exc).__name__}): it stopped or crashed. The next call reconnects"
            ) from None
        self.num_round_trips += 1
        self._check_model(response)
        if response.status != 200:
            raise _error_of(response, self.url)
        return response

    def _check_model(self, response: urllib3.BaseHTTPResponse) -> None:
        served = response.headers.get(protocol.MODEL_ID_HEADER)
        if self.model_id is not None and served is not None and served != self.model_id:
            raise ServerModelChangedError(
                f"the server at {self.url} now serves another model (id {served}, "
                f"was {self.model_id}); make a new RemoteLM for it"
            )


def _adapter_fields(adapter: Adapter) -> dict:
    return {"name": adapter.name, "path": adapter.path}


def _error_of(response: urllib3.BaseHTTPResponse, url: str) -> Exception:
    try:
        fields = protocol.unpack(response.data)
        kind, message = str(fields["kind"]), str(fields["message"])
    except (ValueError, KeyError):
        kind, message = "", response.data[:200].decode(errors="replace")
    error_type = _ERRORS.get(kind, ServerUnavailableError)
    return error_type(f"{message} (server {url}, HTTP {response.status})")


class RemoteLM(AsyncLM):
    """An :class:`~genlm_backend.llm.base.AsyncLM` whose model runs in a ``genlm-backend serve`` process.

    The whole contract holds (async, sync and batch log-probabilities,
    ``tokenizer``, ``byte_vocab``, sampling, ``lora_name=``, ``cache_kv``,
    ``clear_cache``, ``stats``, ``close``, context managers); rows are the
    server's ``float32`` bytes, unchanged. The vocabulary, tokenizer and limits
    are fetched once, here. Concurrent awaits are batched in this process
    (at most the server's ``max_rows`` per batch) and each batch is one round
    trip; the server batches it again with other clients' requests.

    ``stats`` counts this client's requests; ``num_batches`` are round trips and
    ``num_tokens_computed`` the tokens sent. :meth:`server_stats` gives the
    server's counters. ``clear_cache``/``clear_kv_cache`` clear the server's
    caches too (for every client; results do not change). ``close`` closes
    this client, not the server. LoRA adapters live on the server: those it
    has at connection are known here; ``add_new_lora(path, name)`` loads
    ``path`` on the server's filesystem.

    Args:
        url: ``http://HOST:PORT`` or ``genlm://HOST:PORT``.
        token: Shared token of a server that asks for one (``None``: ``$GENLM_SERVE_TOKEN``).
        connect_timeout_s: Most seconds to open a connection (see :class:`RemoteRunner`).
        read_timeout_s: Most seconds to wait for an answer (see :class:`RemoteRunner`).
        timeout_s: Most seconds a request waits for company before its batch goes.
        output_cache_bytes: This client's own output cache (0 disables it).

    Raises:
        ServerUnavailableError: the server cannot be reached now.
        ServerRejectedError: the server refused the token.
    """

    runner: RemoteRunner

    def __init__(
        self,
        url: str = f"http://127.0.0.1:{protocol.DEFAULT_PORT}",
        *,
        token: str | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 300.0,
        timeout_s: float = 0.02,
        output_cache_bytes: int = DEFAULT_OUTPUT_CACHE_BYTES,
    ):
        runner = RemoteRunner(
            http_url(url),
            token,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
        )
        try:
            info = runner.fetch_info()
            tokenizer = load_tokenizer(info)
        except BaseException:
            runner.close()
            raise
        limits = protocol.ServeLimits(info["max_rows"], None, info["max_body_bytes"])
        super().__init__(
            tokenizer,
            runner,
            batch_size=limits.max_rows,
            timeout_s=timeout_s,
            max_batch_tokens=limits.max_batch_tokens,
            output_cache_bytes=output_cache_bytes,
            max_context_length=info["max_context_length"],
            byte_vocab=byte_vocab_of(info),
            str_vocab=info["str_vocab"],
        )
        for name, path in info["adapters"].items():
            self.adapters.record(self.adapters.new_version(path, name))
        self.url = runner.url
        self.model_name: str = info["model_name"]
        """The model the server was started with (``""`` for its default model)."""
        self.server_backend: str = info["backend"]
        """The server's backend: ``"hf"``, ``"vllm"`` or ``"mock"``."""

    @classmethod
    def from_name(cls, name: str, **kwargs) -> RemoteLM:
        """``RemoteLM(name, **kwargs)`` for ``genlm://HOST:PORT`` names (see ``load_model_by_name``)."""
        return cls(name, **kwargs)

    def server_stats(self) -> tuple[LMStats, ServeStats]:
        """The server's counters: its model's (every client together) and its own.

        Raises:
            ServerUnavailableError: the server cannot answer.
        """
        fields = self.runner.server_stats()
        return LMStats(**fields["lm"]), ServeStats(**fields["server"])

    def clear_kv_cache(self) -> None:
        """Drop the server's retained keys/values (results in both output caches stay)."""
        with self._core.lock:
            self.runner.clear_server("kv")


def http_url(url: str) -> str:
    """``genlm://HOST:PORT`` -> ``http://HOST:PORT``; an ``http(s)://`` URL unchanged.

    Raises:
        ValueError: any other scheme.
    """
    if url.startswith(REMOTE_SCHEME):
        return "http://" + url[len(REMOTE_SCHEME) :]
    if url.startswith(("http://", "https://")):
        return url
    raise ValueError(f"a server address is genlm://HOST:PORT or http://HOST:PORT, got {url!r}")
