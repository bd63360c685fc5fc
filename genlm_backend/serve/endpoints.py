"""The server's small endpoints: its model's identity and counters, adapters, clearing caches.

Each takes a msgpack body and answers a msgpack map; a malformed body raises
``ValueError`` (the app answers it with HTTP 400).

Adapters load over the API only from the folders the server was started with
(``--adapter-dir``; none by default): a path outside them, or a hub id, is
refused with ``PermissionError``. A load that fails is answered without its
exception's text, which could tell a client what exists on the server; the
server's log has it. On a server without a token, a client may remove only the
adapters it registered, and no client may clear the server's caches (with a
token, every client holds it and may do both).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict

from genlm_backend.llm.base import AsyncLM
from genlm_backend.llm.remote import protocol

Handler = Callable[[bytes], Awaitable[tuple[bytes, str]]]


def model_routes(
    lm: AsyncLM,
    info: dict,
    server_stats: Callable[[], dict],
    adapter_dirs: Sequence[str] = (),
    log: Callable[[str], None] = print,
    has_token: bool = False,
) -> dict[tuple[str, str], Handler]:
    """``(method, path) -> handler`` for ``/v1/info``, ``/v1/stats``, ``/v1/lora`` and ``/v1/clear``.

    ``adapter_dirs``: the folders adapters may be loaded from over the API;
    ``has_token``: every request carries the server's token (any client may then
    remove any adapter).
    """
    allowed = [os.path.realpath(folder) for folder in adapter_dirs]
    owners: dict[str, str | None] = {}  # adapter name -> the client that registered it

    async def get_info(body: bytes) -> tuple[bytes, str]:
        return _answer({**info, **_adapters(lm)})

    async def get_stats(body: bytes) -> tuple[bytes, str]:
        return _answer({"lm": asdict(lm.stats), "server": server_stats()})

    async def post_lora(body: bytes) -> tuple[bytes, str]:
        fields = protocol.unpack(body)
        op, name, path = fields.get("op"), fields.get("name"), fields.get("path", "")
        client = fields.get("client")
        if not (isinstance(name, str) and isinstance(path, str)):
            raise ValueError("malformed request body: 'name' and 'path' must be strings")
        if client is not None and not isinstance(client, str):
            raise ValueError("malformed request body: 'client' must be a string")
        if op == "add":
            local = _allowed_path(path, allowed)
            try:
                await asyncio.to_thread(lm.add_new_lora, local, name)
            except Exception as exc:  # noqa: BLE001 - its text stays in the server's log
                log(f"adapter {name!r} from {local} failed to load: {type(exc).__name__}: {exc}")
                raise ValueError(
                    f"adapter {name!r} could not be loaded from {path!r} (the server's log says why)"
                ) from None
            owners[name] = client
        elif op == "remove":
            current = lm.adapters.registered().get(name)
            version = fields.get("version")
            if current is not None and version is not None and current.version != version:
                return _answer(_adapters(lm))  # the caller's registration was replaced: gone
            if not has_token and current is not None:
                owner = owners.get(name)
                if owner is None or owner != client:
                    raise PermissionError(
                        f"adapter {name!r} was registered by another client (or at start); on a "
                        "server without a token a client removes only its own"
                    )
            await asyncio.to_thread(lm.remove_lora, name)
            owners.pop(name, None)
        else:
            raise ValueError(f"malformed request body: 'op' must be 'add' or 'remove', got {op!r}")
        return _answer(_adapters(lm))

    async def post_clear(body: bytes) -> tuple[bytes, str]:
        if not has_token:  # the caches are every client's: only the token's holders clear them
            raise PermissionError(
                "clearing the server's caches needs a server with a token (--token-file); "
                "a client's own cache clears without it"
            )
        what = protocol.unpack(body).get("what")
        if what not in ("all", "kv"):
            raise ValueError(f"malformed request body: 'what' must be 'all' or 'kv', got {what!r}")
        await asyncio.to_thread(lm.clear_cache if what == "all" else lm.clear_kv_cache)
        return _answer({})

    return {
        ("GET", "/v1/info"): get_info,
        ("GET", "/v1/stats"): get_stats,
        ("POST", "/v1/lora"): post_lora,
        ("POST", "/v1/clear"): post_clear,
    }


def _answer(fields: dict) -> tuple[bytes, str]:
    return protocol.pack(fields), protocol.MSGPACK_CONTENT_TYPE


def _adapters(lm: AsyncLM) -> dict[str, dict]:
    """Each adapter's folder, and its registration (which a client names in its requests)."""
    registered = lm.adapters.registered()
    return {
        "adapters": {name: adapter.path for name, adapter in registered.items()},
        "adapter_versions": {name: adapter.version for name, adapter in registered.items()},
    }


def _allowed_path(path: str, allowed: Sequence[str]) -> str:
    """``path`` resolved in the first of the ``allowed`` folders (or as given, if absolute).

    Raises:
        PermissionError: no folders are allowed, or ``path`` leads out of them (``..``,
            a link, an absolute path elsewhere, a hub id that no folder holds).
    """
    if not allowed:
        raise PermissionError(
            "this server loads no adapters over its API; start it with --adapter-dir FOLDER "
            "to allow those in FOLDER"
        )
    resolved = os.path.realpath(os.path.join(allowed[0], path))  # an absolute path stays itself
    if not any(os.path.commonpath([resolved, folder]) == folder for folder in allowed):
        raise PermissionError(f"adapter path {path!r} is not in a folder this server loads from")
    return resolved
