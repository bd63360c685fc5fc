"""Names of LoRA adapters, resolved per request into :class:`~genlm_backend.llm.runner.Adapter`\\ s."""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from genlm_backend.llm.runner import Adapter, Request

if TYPE_CHECKING:
    from genlm_backend.cache.output import OutputCache
    from genlm_backend.llm.runner import Runner


class AdapterRegistry:
    """The adapters a backend has loaded, by name, and the default one.

    ``lora_name=None`` on a request means the default adapter: the base model
    unless :meth:`set_default` chose one.
    """

    def __init__(self):
        self._adapters: dict[str, Adapter] = {}
        self._versions = itertools.count(1)
        self.default: Adapter | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def registered(self) -> dict[str, Adapter]:
        """The registered adapters by name (a copy)."""
        return dict(self._adapters)

    def new_version(self, lora_path, lora_name: str) -> Adapter:
        """A new registration of ``lora_name`` (not yet recorded: see :meth:`record`).

        Raises:
            TypeError: ``lora_name`` is not a string.
        """
        if not isinstance(lora_name, str):
            raise TypeError(f"lora_name must be a str, got {type(lora_name).__name__}")
        return Adapter(lora_name, next(self._versions), str(lora_path))

    def record(self, adapter: Adapter) -> Adapter | None:
        """Make ``adapter`` the one its name means; returns the registration it replaces."""
        old = self._adapters.get(adapter.name)
        self._adapters[adapter.name] = adapter
        if self.default is not None and self.default.name == adapter.name:
            self.default = adapter
        return old

    def forget(self, lora_name: str) -> Adapter:
        """Remove ``lora_name`` (and unset it as the default).

        Raises:
            ValueError: unknown name.
        """
        adapter = self.get(lora_name)
        del self._adapters[lora_name]
        if self.default == adapter:
            self.default = None
        return adapter

    def get(self, lora_name: str) -> Adapter:
        """The adapter registered as ``lora_name``.

        Raises:
            ValueError: unknown name (the message names it and how to register it).
        """
        adapter = self._adapters.get(lora_name) if isinstance(lora_name, str) else None
        if adapter is None:
            known = ", ".join(map(repr, self._adapters)) or "none"
            raise ValueError(
                f"unknown LoRA adapter {lora_name!r} (registered: {known}); register it with add_new_lora()"
            )
        return adapter

    def resolve(self, lora_name: str | None) -> Adapter | None:
        """The adapter a request with ``lora_name`` runs under (``None``: the default)."""
        return self.default if lora_name is None else self.get(lora_name)

    def is_current(self, adapter: Adapter | None) -> bool:
        """Whether results computed under ``adapter`` may be cached (it was not replaced or removed since)."""
        return adapter is None or self._adapters.get(adapter.name) == adapter


class AdapterMethods:
    """The LoRA methods of :class:`~genlm_backend.llm.base.AsyncLM` (``adapters``, ``runner``,
    ``output_cache`` and the compute lock are the AsyncLM's)."""

    if TYPE_CHECKING:  # provided by AsyncLM
        adapters: AdapterRegistry
        runner: Runner
        output_cache: OutputCache
        _compute_lock: threading.Lock

        def _check_open(self) -> None: ...

    def add_new_lora(self, lora_path, lora_name: str = "lora_1") -> None:
        """Load a LoRA adapter from ``lora_path`` as ``lora_name``; select it per call with ``lora_name=``.

        Registering an existing name replaces its weights and drops exactly
        the results and keys/values cached under the old ones.

        Raises:
            ValueError: this backend cannot serve adapters (the message says why).
            ImportError: peft is missing (transformers backend).
        """
        adapter = self.adapters.new_version(lora_path, lora_name)
        with self._compute_lock:
            self._check_open()
            old = self.adapters.get(lora_name) if lora_name in self.adapters else None
            if old is not None:
                self._drop_adapter(old)
            self.runner.load_adapter(adapter)
            self.adapters.record(adapter)

    def remove_lora(self, lora_name: str) -> None:
        """Unload ``lora_name`` and drop exactly its cached results and keys/values.

        Raises:
            ValueError: unknown ``lora_name``.
        """
        with self._compute_lock:
            adapter = self.adapters.forget(lora_name)
            self._drop_adapter(adapter)

    def _drop_adapter(self, adapter) -> None:
        self.output_cache.discard_if(
            lambda request: isinstance(request, Request) and request.adapter == adapter
        )
        self.runner.unload_adapter(adapter)

    def set_lora(self, lora_path=None, lora_name: str = "lora_1") -> None:
        """Make ``lora_name`` the default adapter: the one calls with ``lora_name=None`` run under.

        Loads it from ``lora_path`` first when given. Calls that pass
        ``lora_name=`` are not affected; requests already made keep the
        adapter they were made under.

        Raises:
            ValueError: ``lora_name`` is unknown and no ``lora_path`` is given.
        """
        if lora_path is not None:
            self.add_new_lora(lora_path, lora_name)
        self.adapters.default = self.adapters.get(lora_name)

    def clear_lora(self) -> None:
        """Make the base model the default again (adapters stay loaded)."""
        self.adapters.default = None
