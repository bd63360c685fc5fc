"""One model, many processes: ``genlm-backend serve``.

A server process holds one :class:`~genlm_backend.llm.base.AsyncLM` (its
engine, KV prefix tree and output cache); every client's requests go into it,
so requests of different processes share forward passes. A client is a
:class:`~genlm_backend.llm.remote.RemoteLM`, an ``AsyncLM`` like any other:
``load_model_by_name("genlm://127.0.0.1:8765")`` (the client's side lives in
:mod:`genlm_backend.llm.remote`, with the protocol both sides speak).

* :mod:`~genlm_backend.serve.app`: the ASGI application (batching across clients, disconnects, shutdown);
* :mod:`~genlm_backend.serve.rows`: a request's rows, held ones looked up before validation;
* :mod:`~genlm_backend.serve.gather`: batches that gather every client's step;
* :mod:`~genlm_backend.serve.sessions`: rows through shared memory on one machine;
* :mod:`~genlm_backend.serve.channel`: a session's requests over a local socket;
* :mod:`~genlm_backend.serve.asgi`, :mod:`~genlm_backend.serve.endpoints`: bodies in, answers out;
  the small endpoints (info, stats, adapters, clearing);
* :mod:`~genlm_backend.serve.info`: what a client learns at connection;
* :mod:`~genlm_backend.serve.server`: uvicorn, binding rules, signals;
* :mod:`~genlm_backend.serve.cli`: the ``serve`` subcommand.
"""

from genlm_backend.llm.remote import REMOTE_SCHEME, RemoteLM, RemoteRunner, ServeStats
from genlm_backend.llm.remote.protocol import ServeLimits
from genlm_backend.serve.app import ServeApp
from genlm_backend.serve.server import serve

__all__ = [
    "REMOTE_SCHEME",
    "RemoteLM",
    "RemoteRunner",
    "ServeApp",
    "ServeLimits",
    "ServeStats",
    "serve",
]
