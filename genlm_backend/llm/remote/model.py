"""The client side: :class:`RemoteLM`, an ``AsyncLM`` whose runner is a :class:`RemoteRunner`.

``RemoteLM`` is an ordinary :class:`~genlm_backend.llm.base.AsyncLM` whose
runner is a server. Validation, the output cache, the auto-batcher, the sync
bridge and sampling are the in-process ones, so concurrent awaits in one
client become one batch, and that batch is one POST::

    await next_token_logprobs(ids) -> validate -> output cache -> the engine's step
        -> worker thread: RemoteRunner.run(requests) -> POST /v1/logprobs
        -> rows from this client's shared-memory slab (same machine), else float32 bytes
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from genlm_backend.llm.base import DEFAULT_OUTPUT_CACHE_BYTES, AsyncLM
from genlm_backend.llm.remote import protocol
from genlm_backend.llm.remote.runner import RemoteRunner
from genlm_backend.llm.remote.stats import ServeStats
from genlm_backend.llm.stats import LMStats

__all__ = ["REMOTE_SCHEME", "RemoteLM", "RemoteRunner", "http_url"]

REMOTE_SCHEME = "genlm://"
"""Model names starting with this are servers: ``load_model_by_name("genlm://127.0.0.1:8765")``."""


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
        shared_memory: Offer the server shared memory for rows (used only if the
            server runs on this machine; see :class:`RemoteRunner`); its session also
            carries the batches, over a local socket instead of HTTP. ``False``: HTTP
            and rows in answer bodies.

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
        shared_memory: bool = True,
    ):
        runner = RemoteRunner(
            http_url(url),
            token,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            shared_memory=shared_memory,
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
            output_cache_views=False,  # rows in lent slab regions: the cache keeps copies
            max_context_length=info["max_context_length"],
            byte_vocab=byte_vocab_of(info),
            str_vocab=info["str_vocab"],
        )
        for name, path in info["adapters"].items():
            self.adapters.record(self.adapters.new_version(path, name))
        runner.server_versions.update(info.get("adapter_versions", {}))
        # A step waits on the server's socket: it runs in a worker thread, and the
        # event loop stays free meanwhile.
        self.engine.compute_in_loop = False
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
        """Drop the server's retained keys/values (results in both output caches stay); a
        server without a token keeps them (its caches are every client's)."""
        with self.engine.lock:
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


def byte_vocab_of(info: dict) -> list:
    """The server's ``byte_vocab`` from its info: ``Token``\\ s where the server has them."""
    from genlm_backend.tokenization import Token

    token_ids = info.get("token_ids")
    if token_ids is None:
        return list(info["byte_vocab"])
    return [Token(token_id, token) for token_id, token in zip(token_ids, info["byte_vocab"])]


def load_tokenizer(info: dict):
    """The server's Hugging Face tokenizer from its info (``None`` where it has none).

    Loaded from the files :func:`tokenizer_files` sent; its ``name_or_path`` is
    the server's (some libraries pick per-model behaviour by it, e.g.
    genlm-control's canonical-tokenization overrides for GPT-2).
    """
    files = info.get("tokenizer_files")
    if files is None:
        return None
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="genlm-remote-tokenizer-") as folder:
        for name, content in files.items():
            (Path(folder) / Path(name).name).write_bytes(content)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    if info.get("tokenizer_name_or_path") is not None:
        tokenizer.name_or_path = info["tokenizer_name_or_path"]
    return tokenizer
