"""The server's ASGI application: every client's requests go into one :class:`AsyncLM`.

All connections are served on one event loop, so the ``AsyncLM``'s batcher
sees every client's pending contexts at once and batches them together. The
data path of one ``/v1/logprobs`` request::

    token check -> body (size-limited) -> decode + limits
        -> every row in the output cache? rows.held_rows, at once
           else: step gather -> rows.batch_rows (raced against the client's
           disconnect and the server's shutdown)
        -> rows into the client's slab, else float32 bytes

The step gather (:mod:`~genlm_backend.serve.gather`) holds a request until
every client that is stepping has sent its own, so a step of all clients is
one batch. A client on this machine that opened a slab session
(``/v1/session``, :mod:`~genlm_backend.serve.sessions`) gets its rows in
shared memory; any other gets them in the answer's body.

A client that disconnects cancels its request: contexts still queued are
dropped before they cost model work. A shutdown fails every request in flight
with a ``ShuttingDown`` answer and ends every slab session.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict

import torch

from genlm_backend.errors import BackendClosedError, RequestTooLargeError
from genlm_backend.llm.base import AsyncLM
from genlm_backend.llm.remote import protocol
from genlm_backend.llm.remote.protocol import LogprobsRequest, ServeLimits
from genlm_backend.llm.remote.slab import SlabRefused
from genlm_backend.llm.remote.stats import ServeStats
from genlm_backend.serve.asgi import (
    ClientGone,
    Reject,
    end_open_answer,
    read_body,
    send_answer,
    send_open_answer,
    wait_for_disconnect,
)
from genlm_backend.serve.channel import ChannelServer
from genlm_backend.serve.endpoints import model_routes
from genlm_backend.serve.gather import StepGather
from genlm_backend.serve.info import model_info
from genlm_backend.serve.rows import batch_rows, held_rows
from genlm_backend.serve.sessions import SlabSessions

__all__ = ["Log", "ServeApp", "ServeStats"]

Log = Callable[[str], None]


class ServeApp:
    """ASGI application serving one :class:`AsyncLM` to many clients.

    Args:
        lm: The model; owned by the caller until :meth:`begin_shutdown` closes it.
        limits: Per-request limits; its ``max_context_length`` defaults to the model's.
        token: Shared secret every request must carry (``Authorization: Bearer``); ``None``: none asked.
        adapter_dirs: Folders that ``POST /v1/lora`` may load adapters from (none: it loads none).
        model_name: Shown to clients (``RemoteLM.model_name``).
        log: Where event lines go (a client went away, shutdown).
    """

    def __init__(
        self,
        lm: AsyncLM,
        limits: ServeLimits,
        *,
        token: str | None = None,
        model_name: str = "",
        backend: str = "",
        adapter_dirs: Sequence[str] = (),
        log: Log = print,
    ):
        self.lm = lm
        # The loop must keep reading requests and disconnects while a batch computes.
        lm.engine.compute_in_loop = False
        self.limits = limits
        self._token = None if token is None else f"Bearer {token}".encode()
        self.log = log
        self.info = model_info(lm, limits, model_name, backend)
        self._model_id = self.info["model_id"].encode()
        self.closing = asyncio.Event()
        self.closing_reason = ""
        self.closing_watch_task: asyncio.Future | None = None
        self.in_flight: set[asyncio.Task] = set()
        self.held_sessions: set[asyncio.Task] = set()
        self.sessions = SlabSessions(lm.vocab_size)
        self.gather = StepGather()
        self.channel = ChannelServer(self)
        """Requests of slab sessions over a local socket (see :mod:`~genlm_backend.serve.channel`)."""
        self._num_logprobs_in_flight = 0
        self._counts = dict.fromkeys(("requests", "rows", "rejected", "cancelled", "shutdown"), 0)
        self._routes = model_routes(
            lm,
            self.info,
            lambda: asdict(self.stats),
            adapter_dirs,
            log=log,
            has_token=token is not None,
        )

    @property
    def stats(self) -> ServeStats:
        c = self._counts
        gather = self.gather.stats
        return ServeStats(
            num_requests=c["requests"],
            num_rows_served=c["rows"],
            num_rejected=c["rejected"],
            num_cancelled_by_disconnect=c["cancelled"],
            num_failed_by_shutdown=c["shutdown"],
            num_in_flight=self._num_logprobs_in_flight,
            num_shared_memory_clients=self.sessions.num_open,
            num_rows_in_shared_memory=self.sessions.num_rows_written,
            num_groups=gather.num_groups,
            num_waits_given_up=gather.num_waits_given_up,
        )

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        task = asyncio.current_task()
        assert task is not None  # an ASGI app always runs in a task
        is_session = (scope["method"], scope["path"]) == ("POST", "/v1/session")
        tasks = self.held_sessions if is_session else self.in_flight
        tasks.add(task)
        try:
            if is_session:
                await self._hold_session(scope, receive, send)
                return
            body, content_type = await self._answer(scope, receive)
            await send_answer(send, 200, body, content_type, self._model_id)
        except Reject as reject:
            self.count_rejected(reject)
            status = protocol.ERROR_STATUS[reject.kind]
            body = protocol.error_body(reject.kind, str(reject))
            await send_answer(send, status, body, protocol.MSGPACK_CONTENT_TYPE, self._model_id)
        except ClientGone:
            pass  # nobody to answer
        finally:
            tasks.discard(task)

    async def _answer(self, scope, receive) -> tuple[bytes, str]:
        """The answer's body and content type. Raises ``Reject`` or ``ClientGone``."""
        self._check_admission(scope)
        route = (scope["method"], scope["path"])
        if route == ("POST", "/v1/logprobs"):
            return await self._post_logprobs(scope, receive)
        handler = self._routes.get(route)
        if handler is None:
            raise Reject("NotFound", f"no endpoint {scope['method']} {scope['path']}")
        body = await read_body(scope, receive, self.limits.max_body_bytes)
        try:
            return await handler(body)
        except (TypeError, ValueError) as exc:  # the handlers' own messages, about the request
            raise Reject(type(exc).__name__, str(exc)) from None
        except PermissionError as exc:
            raise Reject("Forbidden", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - its text stays here: it may name server files
            self.log(f"{scope['method']} {scope['path']} failed: {type(exc).__name__}: {exc}")
            raise Reject(
                "ModelError", "the server failed this request (its log says why)"
            ) from None

    @property
    def has_token(self) -> bool:
        """Whether requests need the shared token."""
        return self._token is not None

    def _check_admission(self, scope) -> None:
        """Raises ``Reject`` for a request without the token, or once the server is closing."""
        self._check_token(scope)
        if self.closing.is_set():
            raise Reject("ShuttingDown", self.shutdown_message())

    def _check_token(self, scope) -> None:
        if self._token is None:
            return
        sent = dict(scope["headers"]).get(protocol.TOKEN_HEADER.encode())
        if sent is None or not hmac.compare_digest(sent, self._token):
            what = "no token" if sent is None else "a wrong token"
            raise Reject("Unauthorized", f"this server needs its shared token; got {what}")

    # ------------------------------------------------------------------ endpoints

    async def _post_logprobs(self, scope, receive) -> tuple[bytes, str]:
        body = await read_body(scope, receive, self.limits.max_body_bytes)
        host, port = scope.get("client") or ("?", 0)
        return await self.answer_logprobs(
            body, lambda: wait_for_disconnect(receive), f"client {host}:{port}"
        )

    async def answer_logprobs(
        self, body: bytes, gone: Callable[[], Awaitable], who: str, session: str | None = None
    ) -> tuple[bytes, str]:
        """A ``/v1/logprobs`` body's answer and its content type, over HTTP or a local channel.

        ``gone()`` ends when the client goes away (its request is then cancelled);
        ``who`` names the client in the log; ``session``: the one a local channel's
        hello named, the only one its requests may write to. Raises ``Reject`` or
        ``ClientGone``.
        """
        self._counts["requests"] += 1
        try:
            request = protocol.decode_logprobs_request(body, self.limits)
        except RequestTooLargeError as exc:
            raise Reject("RequestTooLarge", str(exc)) from None
        except ValueError as exc:
            raise Reject("ValueError", str(exc)) from None
        if session is not None and request.session not in (None, session):
            raise Reject("Unauthorized", "a request may name only its channel's own session")
        self._check_adapters(request)
        rows = self._held_rows(request)
        if rows is None:
            self._num_logprobs_in_flight += 1
            try:
                rows = await self._until_gone_or_closing(self._gathered(request), gone, who)
            finally:
                self._num_logprobs_in_flight -= 1
        elif request.client is not None:
            self.gather.answered_without_model(request.client)
        self._counts["rows"] += len(rows)
        if self.sessions.write(request.session, rows, request.slab_row):
            return protocol.pack({"num_rows": len(rows)}), protocol.SLAB_CONTENT_TYPE
        return protocol.encode_rows(rows), protocol.ROWS_CONTENT_TYPE

    def _check_adapters(self, request: LogprobsRequest) -> None:
        """Refuse a request whose adapter's registration changed since its client learned it:
        rows under other weights than the client registered are never answered."""
        if request.lora_versions is None:
            return
        registered = self.lm.adapters.registered()
        for name, version in zip(request.lora_names, request.lora_versions):
            if name is None or version is None:
                continue
            current = registered.get(name)
            if current is None or current.version != version:
                what = "removed" if current is None else "registered again (by another client?)"
                raise Reject(
                    "ValueError",
                    f"LoRA adapter {name!r} was {what} on the server since this client registered "
                    "it; register it again to use the server's current one",
                )

    def _held_rows(self, request: LogprobsRequest) -> list[torch.Tensor] | None:
        """The request's rows if the output cache holds every one (of one adapter): they need
        no model work, so they are answered at once, without waiting for the step gather or a
        batch that computes. ``None`` otherwise (nothing counted)."""
        names = set(request.lora_names)
        if request.uncached or len(names) != 1:
            return None
        try:
            return held_rows(self.lm, request.contexts, names.pop())
        except BackendClosedError:
            raise Reject("ShuttingDown", self.shutdown_message()) from None
        except (TypeError, ValueError) as exc:
            raise Reject(type(exc).__name__, str(exc)) from None

    async def _gathered(self, request: LogprobsRequest) -> list[torch.Tensor]:
        """:meth:`_compute`, once the step gather lets the request through."""
        client: object = request.client if request.client is not None else object()
        await self.gather.admit(client)
        is_expected_back = request.client is not None
        try:
            return await self._compute(request)
        except asyncio.CancelledError:
            is_expected_back = False  # its client went away, or the server is closing
            raise
        finally:
            self.gather.answered(client, is_expected_back=is_expected_back)

    async def _compute(self, request: LogprobsRequest) -> list[torch.Tensor]:
        """The request's rows, ``[V]`` each, in its order; contexts of each adapter go in one call.

        The rows are the model's own (cached or just computed): they are copied
        once, into the client's slab or the answer, never stacked first.
        """
        lm = self.lm
        if request.uncached:
            row = await asyncio.to_thread(
                lm.next_token_logprobs_uncached, request.contexts[0], request.lora_names[0]
            )
            return [row]
        groups: dict[str | None, list[int]] = {}
        for position, name in enumerate(request.lora_names):
            groups.setdefault(name, []).append(position)
        results = await asyncio.gather(
            *(
                batch_rows(lm, [request.contexts[i] for i in positions], name)
                for name, positions in groups.items()
            )
        )
        rows: list[torch.Tensor] = [None] * len(request.contexts)  # type: ignore[list-item]
        for positions, group_rows in zip(groups.values(), results):
            for position, row in zip(positions, group_rows):
                rows[position] = row
        return rows

    async def _hold_session(self, scope, receive, send) -> None:
        """``POST /v1/session``: map the client's slab, and keep it while this answer stays open.

        Raises ``Reject`` (a bad offer; a refused slab is an answer, not an error) or ``ClientGone``.
        """
        self._check_admission(scope)
        body = await read_body(scope, receive, self.limits.max_body_bytes)
        try:
            offer = protocol.decode_slab_offer(body, self.limits)
        except RequestTooLargeError as exc:
            raise Reject("RequestTooLarge", str(exc)) from None
        except ValueError as exc:
            raise Reject("ValueError", str(exc)) from None
        try:
            session = self.sessions.open(offer)
        except SlabRefused as exc:
            refusal = protocol.pack({"accepted": False, "session": "", "reason": str(exc)})
            await send_answer(send, 200, refusal, protocol.MSGPACK_CONTENT_TYPE, self._model_id)
            return
        try:
            accepted = protocol.pack(
                {
                    "accepted": True,
                    "session": session,
                    "reason": "",
                    "channel": await self.channel.address(),
                }
            )
            await send_open_answer(send, accepted, protocol.MSGPACK_CONTENT_TYPE, self._model_id)
            await _first_of(wait_for_disconnect(receive), self.closing.wait())
            if self.closing.is_set():
                await end_open_answer(send)
        finally:
            client = self.sessions.close(session)
            if client is not None and not self.sessions.has_client(client):
                self.gather.forget(client)

    async def _until_gone_or_closing(
        self, work: Awaitable, gone_wait: Callable[[], Awaitable], who: str
    ):
        """``work``'s result, unless the client goes away (``gone_wait()`` ends) or the server
        closes first (then cancelled)."""
        compute = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(gone_wait())
        try:
            await asyncio.wait(
                {compute, gone, self.closing_watch()}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            gone.cancel()  # nobody awaits it: it ends on the loop's next pass
            if not compute.done():
                compute.cancel()
                await asyncio.wait({compute})  # its clean-up runs before the answer
        if not compute.cancelled():
            return _result_or_reject(compute, self.shutdown_message)
        if self.closing.is_set():
            raise Reject("ShuttingDown", self.shutdown_message())
        self._counts["cancelled"] += 1
        self.log(f"{who} went away: its request was cancelled")
        raise ClientGone

    def closing_watch(self) -> asyncio.Future:
        """A task done once the server closes: one for every request (none made per request)."""
        task = self.closing_watch_task
        if task is None or task.get_loop() is not asyncio.get_running_loop():
            task = self.closing_watch_task = asyncio.ensure_future(self.closing.wait())
        return task

    # ------------------------------------------------------------------ shutdown

    async def begin_shutdown(self, reason: str, grace_s: float = 5.0) -> None:
        """Fail every request in flight with ``ShuttingDown`` (naming ``reason``), then close the model.

        Waits up to ``grace_s`` for those answers to be sent. Idempotent.
        """
        if self.closing.is_set():
            return
        self.closing_reason = reason
        num_pending = len(self.in_flight)
        self.closing.set()
        self.log(f"shutting down ({reason}): failing {num_pending} request(s) in flight")
        pending = self.in_flight | self.held_sessions
        pending.discard(asyncio.current_task())  # type: ignore[arg-type]
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
        self.sessions.close_all()
        self.channel.close()  # its connections ended above
        await self.lm.aclose()

    @property
    def max_body_bytes(self) -> int:
        return self.limits.max_body_bytes

    def count_rejected(self, reject: Reject) -> None:
        self._counts["rejected" if reject.kind != "ShuttingDown" else "shutdown"] += 1

    def shutdown_message(self) -> str:
        reason = f" ({self.closing_reason})" if self.closing_reason else ""
        return f"the server is shutting down{reason}; this request was not computed"


def _result_or_reject(task: asyncio.Future, shutdown_message: Callable[[], str]):
    """``task``'s result; its error as the ``Reject`` the client should get."""
    error = task.exception()
    if error is None:
        return task.result()
    if isinstance(error, BackendClosedError):
        raise Reject("ShuttingDown", shutdown_message())
    if isinstance(error, (TypeError, ValueError)):
        raise Reject(type(error).__name__, str(error))
    raise Reject("ModelError", f"{type(error).__name__}: {error}")


async def _first_of(*waits: Awaitable) -> None:
    """Return once one of ``waits`` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
