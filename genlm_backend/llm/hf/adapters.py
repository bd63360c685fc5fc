"""LoRA adapters of a transformers model, through peft: load, activate per batch group, unload."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from genlm_backend.llm.runner import Adapter


class PeftAdapters:
    """The peft adapters loaded into one model, by name.

    The model is wrapped in a ``peft.PeftModel`` when the first adapter is
    loaded and unwrapped when the last one is unloaded (:attr:`model`
    follows). Inside peft, each registration has its own name
    (:func:`peft_name`), so weights are never mixed up across registrations
    of one name. Each registration is remembered as its
    :class:`~genlm_backend.llm.runner.Adapter`, so a request made under weights
    that were since replaced or removed fails instead of running under others.
    """

    def __init__(self, model):
        self.model = model
        self._loaded: dict[str, Adapter] = {}

    def load(self, adapter: Adapter) -> None:
        """Load ``adapter``'s weights under its name, replacing an adapter of that name.

        Raises:
            ImportError: peft is not installed.
        """
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise ImportError("LoRA adapters need peft: pip install peft") from exc
        old = self._loaded.get(adapter.name)
        if isinstance(self.model, PeftModel):
            self.model.load_adapter(adapter.path, adapter_name=peft_name(adapter))
        else:
            self.model = PeftModel.from_pretrained(
                self.model, adapter.path, adapter_name=peft_name(adapter)
            )
        self.model.eval()
        self._loaded[adapter.name] = adapter
        if old is not None:
            self.model.delete_adapter(peft_name(old))

    def unload(self, adapter: Adapter) -> None:
        """Delete ``adapter``'s weights if they are the ones loaded under its name."""
        if self._loaded.get(adapter.name) == adapter:
            self._delete(adapter.name)

    def _delete(self, name: str) -> None:
        adapter = self._loaded.pop(name)
        if not self._loaded:
            self.model = self.model.unload()  # the base model, LoRA layers removed
            return
        if self.model.active_adapter == peft_name(adapter):
            # peft keeps one adapter active: switch to another before deleting this one.
            self.model.set_adapter(peft_name(next(iter(self._loaded.values()))))
        self.model.delete_adapter(peft_name(adapter))

    @contextmanager
    def active(self, adapter: Adapter | None) -> Iterator[None]:
        """Run the model under ``adapter`` (``None``: the base model) within this block.

        Raises:
            ValueError: ``adapter`` is no longer the registration loaded under its name.
        """
        if adapter is None:
            if self._loaded:
                with self.model.disable_adapter():
                    yield
            else:
                yield
            return
        if self._loaded.get(adapter.name) != adapter:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} was removed or re-registered while this request waited"
            )
        self.model.set_adapter(peft_name(adapter))
        yield


def peft_name(adapter: Adapter) -> str:
    """The name a registration has inside peft: unique per registration."""
    return f"genlm_adapter_{adapter.version}"
