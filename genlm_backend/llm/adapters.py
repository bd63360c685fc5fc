"""The LoRA adapters a backend has registered, by name, and the default one."""

from __future__ import annotations

import itertools

from genlm_backend.llm.runner import Adapter


class AdapterRegistry:
    """The adapters a backend has loaded, by name, and the default one.

    ``lora_name=None`` on a request means the default adapter: the base model
    unless :attr:`default` was set to one.
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
