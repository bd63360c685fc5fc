"""The runner of a :class:`~genlm_backend.llm.remote.model.RemoteLM`: one round trip to the server per batch.

Rows come back through this client's shared-memory slab when the server
runs on this machine (:mod:`~genlm_backend.llm.remote.client_slab`), else in the
answer's body.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence

import torch
import urllib3

from genlm_backend.errors import ServerModelChangedError, ServerUnavailableError
from genlm_backend.llm.remote import http, protocol
from genlm_backend.llm.remote.channel import ROWS_ANSWER, SLAB_ANSWER
from genlm_backend.llm.remote.client_slab import ClientSlab
from genlm_backend.llm.remote.protocol import TOKEN_ENV
from genlm_backend.llm.remote.slab import SlabRefused
from genlm_backend.llm.runner import Adapter, Request, RunnerStats, ScoreRequest, score_from_rows


class RemoteRunner:
    """A :class:`~genlm_backend.llm.runner.Runner` whose model is a ``genlm-backend serve`` server.

    Synchronous (it runs in the ``AsyncLM``'s worker thread or a ``*_sync``
    caller's thread); each call is one round trip: a frame each way on its
    slab session's local channel (:mod:`~genlm_backend.llm.remote.channel`) on the
    server's machine, else one HTTP request (urllib3) on a kept-alive
    connection; either is reopened on the next call after a failure. Nothing is
    retried.

    Rows: on the server's machine, the server writes them into this client's
    shared-memory slab (:class:`~genlm_backend.llm.remote.client_slab.ClientSlab`),
    in a region lent to the tensor :meth:`run` returns (no copy here) or, when
    the caller still holds every lent region, in its scratch part, from which
    they are copied once; elsewhere (or with ``shared_memory=False``) they
    travel in the answer's body. The slab is offered at the first batch and
    replaced by one twice as large when a batch needs more rows (batches of
    at most the server's ``max_rows``; the slab holds three batches): at most
    one per client, freed when the client closes or dies and its lent tensors
    are gone. A slab is never reused after a round trip that failed without
    an answer (the server may still write into it): the next call offers a new one.

    Args:
        url: ``http://HOST:PORT`` of the server.
        token: Shared token (``None``: ``$GENLM_SERVE_TOKEN`` if set).
        connect_timeout_s: Most seconds to open a connection.
        read_timeout_s: Most seconds to wait for an answer (a batch queued behind
            other clients' batches counts too).
        shared_memory: Offer the server a shared-memory slab for rows (and use its
            session's local channel for batches).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 300.0,
        shared_memory: bool = True,
    ):
        self.url = url.rstrip("/")
        token = os.environ.get(TOKEN_ENV) if token is None else token
        self._headers = {protocol.TOKEN_HEADER: f"Bearer {token}"} if token else {}
        self._timeout = urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s)
        self._read_timeout_s = read_timeout_s
        # Two connections: the model's worker thread's, and a caller's (stats, adapters).
        self._http = self._pool(maxsize=2)
        self.client_id = secrets.token_hex(16)
        """Sent with every batch: the server's step gather knows this client by it."""
        self.model_id: str | None = None
        self.vocab_size = 0
        self.max_rows = 1
        self.num_round_trips = 0
        self.num_channel_round_trips = 0
        """Round trips through the slab session's local channel (the others: HTTP)."""
        self.num_rows_lent = 0
        """Rows returned as views of the slab (no copy on this side)."""
        self._num_tokens_sent = 0
        self._slab: ClientSlab | None = None
        self.server_versions: dict[str, int] = {}
        """The server's registration of each adapter name, as this client registered or
        found it: requests name it, so that another client's registration is refused,
        never answered."""
        self.shared_memory_refusal: str | None = None if shared_memory else "shared_memory=False"
        """Why rows travel in answer bodies (``None``: through shared memory, once a batch offered it)."""

    def _pool(self, maxsize: int) -> urllib3.HTTPConnectionPool:
        return urllib3.connection_from_url(
            self.url,
            headers=self._headers,
            timeout=self._timeout,
            retries=False,  # a failure is reported, not hidden; the next call reconnects
            maxsize=maxsize,
        )

    @property
    def slab_name(self) -> str | None:
        """The name of the shared-memory segment this client's rows arrive in, as
        ``/proc/PID/maps`` shows it (``None``: none open)."""
        return None if self._slab is None else self._slab.slab.segment

    @property
    def num_rows_on_loan(self) -> int:
        """Rows of the open slab that returned tensors view now (their regions are not reused)."""
        return 0 if self._slab is None else self._slab.loans.num_lent

    @property
    def stats(self) -> RunnerStats:
        return RunnerStats(num_tokens_computed=self._num_tokens_sent, kv_cache_bytes=0)

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
        self.max_rows = info["max_rows"]
        return info

    def request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget: its context length."""
        return len(request.context)

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Scores gathered from the rows of each continuation's prefixes (one round trip)."""
        return score_from_rows(self.run, requests)

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        return self._logprobs(requests, uncached=False)

    def run_uncached(self, request: Request) -> torch.Tensor:
        return self._logprobs([request], uncached=True)[0]

    def _logprobs(self, requests: Sequence[Request], uncached: bool) -> torch.Tensor:
        contexts = [request.context for request in requests]
        names = [None if r.adapter is None else r.adapter.name for r in requests]
        versions = [None if name is None else self.server_versions.get(name) for name in names]
        num_rows = len(requests)
        slab = self._slab_for(num_rows)
        first_row = 0 if slab is None else slab.region(num_rows)
        body = protocol.encode_logprobs_request(
            contexts,
            names,
            uncached,
            client=self.client_id,
            session=None if slab is None else slab.session,
            slab_row=first_row,
            lora_versions=versions,
        )
        try:
            content_type, data = self._exchange(slab, body)
        except ServerUnavailableError:
            self._close_slab()  # the server may still write into it: never reuse it
            raise
        except BaseException:
            if slab is not None:
                slab.give_back(first_row, num_rows)  # an error answer: nothing was written
            raise
        self._num_tokens_sent += sum(map(len, contexts))
        if content_type == protocol.SLAB_CONTENT_TYPE and slab is not None:
            try:
                expected = _num_rows_in_slab(data, num_rows)
            except ValueError:
                slab.give_back(first_row, num_rows)
                raise
            if first_row:
                self.num_rows_lent += num_rows
            return slab.read(first_row, expected)
        if slab is not None:
            self._close_slab()  # the server no longer holds it (it restarted): offer anew next time
        return protocol.decode_rows(data, num_rows, self.vocab_size)

    def _exchange(
        self, slab: ClientSlab | None, body: bytes
    ) -> tuple[str | None, bytes | memoryview]:
        """A ``/v1/logprobs`` request's answer: its content type and body, through the
        slab's local channel when it has one, else over HTTP.

        Raises:
            ServerUnavailableError: as :meth:`_call`, or the channel closed.
            ServerRejectedError, RequestTooLargeError, RemoteModelError, TypeError, ValueError:
                the server's answer for this request.
        """
        if slab is None or slab.channel is None:
            response = self._call("POST", "/v1/logprobs", body)
            return response.headers.get("content-type"), response.data
        kind, payload = slab.channel.call(body)
        self.num_round_trips += 1
        self.num_channel_round_trips += 1
        if kind == SLAB_ANSWER:
            return protocol.SLAB_CONTENT_TYPE, payload
        if kind == ROWS_ANSWER:
            return protocol.ROWS_CONTENT_TYPE, payload
        raise http.error_of_fields(payload, self.url, "its local channel")

    def _slab_for(self, num_rows: int) -> ClientSlab | None:
        """This client's slab, offered (or replaced by a larger one) if needed; ``None``: use bodies.

        Raises:
            ServerUnavailableError, ServerRejectedError: the offer's round trip failed.
        """
        if self.shared_memory_refusal is not None or num_rows > self.max_rows:
            return None
        if self._slab is not None and self._slab.is_dropped():
            self._close_slab()  # the server stopped or restarted since: offer anew
        if self._slab is not None and self._slab.batch_rows >= num_rows:
            return self._slab
        batch_rows = min(self.max_rows, 1 << (num_rows - 1).bit_length())
        pool = self._pool(maxsize=1)
        try:
            slab = ClientSlab.offer(
                self.url,
                pool,
                self.client_id,
                batch_rows,
                self.vocab_size,
                self._read_timeout_s,
                self._check_model,
            )
        except SlabRefused as exc:
            self.shared_memory_refusal = str(exc)
            self._close_slab()
            return None
        self._close_slab()  # after the new one is open: the server never sees this client leave
        self._slab = slab
        return slab

    def _close_slab(self) -> None:
        slab, self._slab = self._slab, None
        if slab is not None:
            slab.close()

    def load_adapter(self, adapter: Adapter) -> None:
        body = protocol.pack({"op": "add", "client": self.client_id, **_adapter_fields(adapter)})
        answer = protocol.unpack(self._call("POST", "/v1/lora", body).data)
        self.server_versions[adapter.name] = answer["adapter_versions"][adapter.name]

    def unload_adapter(self, adapter: Adapter) -> None:
        version = self.server_versions.pop(adapter.name, None)  # None: one it found at connection
        fields = {
            "op": "remove",
            "client": self.client_id,
            "name": adapter.name,
            "version": version,
        }
        self._call("POST", "/v1/lora", protocol.pack(fields))

    def clear(self) -> None:
        """Drop the server's keys/values and cached rows (every client's: only speed changes),
        where the server lets this client (see :meth:`clear_server`)."""
        self.clear_server("all")

    def clear_server(self, what: str) -> bool:
        """Ask the server to drop its caches (``"all"``) or its keys/values (``"kv"``); whether
        it did. A server without a token clears for no client: clearing changes only speed,
        so its refusal is not an error."""
        try:
            self._call("POST", "/v1/clear", protocol.pack({"what": what}))
        except PermissionError:
            return False
        return True

    def server_stats(self) -> dict:
        return protocol.unpack(self._call("GET", "/v1/stats").data)

    def close(self) -> None:
        self._close_slab()
        self._http.close()

    def _call(self, method: str, path: str, body: bytes | None = None) -> urllib3.BaseHTTPResponse:
        """One request; its failure as the library's exception.

        Raises:
            ServerUnavailableError: unreachable, gone mid-request, no answer in time, shutting down.
            ServerModelChangedError: the server now holds another model.
            ServerRejectedError, RequestTooLargeError, RemoteModelError, TypeError, ValueError:
                the server's answer for this request.
        """
        response = http.send(self._http, self.url, method, path, body)
        self.num_round_trips += 1
        self._check_model(response)
        if response.status != 200:
            raise http.error_of(response, self.url)
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


def _num_rows_in_slab(answer: bytes | memoryview, expected: int) -> int:
    """The row count of a slab answer, checked against the request's.

    Raises:
        ValueError: the server wrote another number of rows.
    """
    num_rows = protocol.unpack(answer).get("num_rows")
    if num_rows != expected:
        raise ValueError(f"expected {expected} rows in the slab, the server wrote {num_rows!r}")
    return expected
