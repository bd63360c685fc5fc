"""Running a :class:`ServeApp` on uvicorn: binding rules, the "listening" line, signal-driven
shutdown, and a heap the garbage collector's full collections skip while it serves.

uvicorn's own signal handling waits for requests to finish; a server whose
requests may wait for a long batch should instead fail them at once with a
clear answer. :class:`_Server` therefore routes SIGINT/SIGTERM to
:meth:`ServeApp.begin_shutdown` first and stops uvicorn after it. A second
signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import signal
import sys
from collections.abc import Iterator, Sequence

import uvicorn

from genlm_backend.llm.base import AsyncLM
from genlm_backend.llm.remote.protocol import TOKEN_ENV, ServeLimits
from genlm_backend.serve.app import Log, ServeApp

"""Environment variable holding the shared token, on the server and on clients."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def check_binding(host: str, allow_remote: bool, token: str | None) -> None:
    """Refuse a non-loopback ``host`` unless ``allow_remote`` and a token are both given.

    Raises:
        ValueError: the message says which of the two is missing.
    """
    if is_loopback(host):
        return
    if not allow_remote:
        raise ValueError(
            f"--host {host} is not a loopback address: anyone who can reach it could use the "
            "model; pass --allow-remote (and a shared token) to serve other machines"
        )
    if not token:
        raise ValueError(
            f"serving on {host} needs a shared token: set {TOKEN_ENV} or pass --token-file"
        )


def serve(
    lm: AsyncLM,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ServeLimits | None = None,
    token: str | None = None,
    allow_remote: bool = False,
    model_name: str = "",
    backend: str = "",
    adapter_dirs: Sequence[str] = (),
    log: Log = print,
) -> ServeApp:
    """Serve ``lm`` until SIGINT or SIGTERM; returns the app (its ``stats``) once stopped.

    Prints ``listening on http://HOST:PORT`` through ``log`` once connections
    are accepted (``port=0`` picks a free port). On a signal, requests in flight
    fail with a ``ShuttingDown`` answer, ``lm`` is closed, and the server stops.

    Raises:
        ValueError: a non-loopback ``host`` without ``allow_remote`` and ``token``.
        SystemExit: the port could not be bound (uvicorn logs why).
    """
    check_binding(host, allow_remote, token)
    app = ServeApp(
        lm,
        limits or ServeLimits(),
        token=token,
        model_name=model_name,
        backend=backend,
        adapter_dirs=adapter_dirs,
        log=log,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="off",
        interface="asgi3",
        http="httptools",
        proxy_headers=False,
        server_header=False,
        date_header=False,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    with frozen_heap():
        asyncio.run(_Server(config, app, log).serve())
    return app


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects alive now (the model's, the libraries', the app's) out of the garbage
    collector's full collections until the block ends (:func:`gc.freeze`), after collecting
    what is garbage among them.

    A full collection walks every object the collector tracks: in a server
    of SmolLM2 it took 190 ms, once in a run of 16 steps, and every client's
    step waited for it (BENCHMARKS.md, "A served model's heap out of full
    collections, ..."). The objects made while serving are collected as before;
    a frozen object that becomes garbage in a reference cycle while serving
    is freed at the thaw (reference counting frees the others at once). A
    process that froze objects itself keeps them frozen: nothing is done.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Server(uvicorn.Server):
    """uvicorn, with our shutdown on the first signal and the listening line on stdout."""

    def __init__(self, config: uvicorn.Config, app: ServeApp, log: Log):
        super().__init__(config)
        self.app = app
        self._log = log
        self._shutdown: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            self._log(f"listening on http://{shown}:{port}")
            if not self.app.has_token:
                self._log(
                    f"no token: every user of this machine can reach {shown}:{port} and use this "
                    "model (the local channel serves this user only); set "
                    f"{TOKEN_ENV} or pass --token-file to require one"
                )

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        handled = (signal.SIGINT, signal.SIGTERM)
        for sig in handled:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._shutdown is not None:
            self.force_exit = True  # a second signal: stop without waiting
            return
        reason = signal.Signals(sig).name
        self._shutdown = asyncio.get_running_loop().create_task(self._shut_down(reason))

    async def _shut_down(self, reason: str) -> None:
        try:
            await self.app.begin_shutdown(reason)
        finally:
            self.should_exit = True


def main_log(prefix: str) -> Log:
    """A ``log`` that prints ``prefix: message`` lines to stdout, flushed (tests wait for them)."""

    def log(message: str) -> None:
        print(f"{prefix}: {message}", file=sys.stdout, flush=True)

    return log
