"""LoRA adapters of an mlx-lm model: load, activate per batch group, unload.

An adapter is a folder as ``mlx_lm.lora`` writes it: ``adapter_config.json``
(``fine_tune_type`` ``"lora"``, ``num_layers``, ``lora_parameters``) and
``adapters.safetensors``. The model's linear layers are wrapped once, by the
first adapter loaded; every adapter is then a set of ``lora_*`` arrays put on
the model when a batch needs it. The base model is the set the wrap starts
from, whose ``lora_b`` arrays are zero: its outputs are the unwrapped model's, bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from genlm_backend.llm.runner import Adapter

WeightSet = list[tuple[str, mx.array]]


class MlxAdapters:
    """The LoRA weight sets loaded over one mlx-lm model, by registration."""

    def __init__(self, model):
        self.model = model
        self._loaded: dict[str, tuple[Adapter, WeightSet]] = {}
        self._layout: tuple[int, dict] | None = None
        self._base: WeightSet = []
        self._installed: WeightSet | None = None

    def load(self, adapter: Adapter) -> None:
        """Load ``adapter``'s weights under its name, replacing an adapter of that name.

        Raises:
            ValueError: the folder is not an mlx-lm LoRA adapter, or its layout
                (layers, rank, scale, keys) differs from the first adapter's
                (the model is wrapped once, for one layout).
        """
        path = Path(adapter.path)
        config_path = path / "adapter_config.json"
        weights_path = path / "adapters.safetensors"
        if not (config_path.is_file() and weights_path.is_file()):
            raise ValueError(
                f"{adapter.path!r} is not an mlx-lm LoRA adapter (adapter_config.json and "
                "adapters.safetensors, as mlx_lm.lora writes them); peft adapters "
                "(adapter_model.safetensors) need the transformers backend"
            )
        config = json.loads(config_path.read_text())
        kind = config.get("fine_tune_type", "lora")
        if kind != "lora":
            raise ValueError(
                f"adapter {adapter.name!r} is {kind!r}; only 'lora' adapters are served"
            )
        self._wrap((int(config["num_layers"]), dict(config["lora_parameters"])), adapter.name)
        loaded = mx.load(str(weights_path))
        assert isinstance(loaded, dict), "a safetensors file loads as a dict"
        weights = [(k, v) for k, v in loaded.items() if "lora_" in k]
        expected = {k for k, _ in self._base}
        unknown = sorted({k for k, _ in weights} - expected)
        if unknown:
            raise ValueError(f"adapter {adapter.name!r} has weights the model lacks: {unknown[:3]}")
        # Evaluated here: MLX arrays still to be computed are bound to this thread's
        # stream, and the batcher's worker thread computes with them.
        mx.eval([v for _, v in weights])
        # A full set: layers the adapter leaves out keep the base's (zero) update.
        self._loaded[adapter.name] = (adapter, list((dict(self._base) | dict(weights)).items()))

    def _wrap(self, layout: tuple[int, dict], name: str) -> None:
        if self._layout is None:
            from mlx_lm.tuner.utils import linear_to_lora_layers

            linear_to_lora_layers(self.model, *layout)
            self.model.eval()  # the new LoRA layers start in training mode (dropout)
            mx.eval(self.model.parameters())  # their initial arrays, on this thread's stream
            self._layout = layout
            flat: list[tuple[str, mx.array]] = tree_flatten(self.model.trainable_parameters())  # type: ignore[assignment]
            self._base = [(k, v) for k, v in flat if "lora_" in k]
            self._installed = self._base
        elif layout != self._layout:
            raise ValueError(
                f"adapter {name!r} has layout {layout}, but the model is wrapped for "
                f"{self._layout} (by the first adapter); every adapter of one model shares a layout"
            )

    def unload(self, adapter: Adapter) -> None:
        """Forget ``adapter``'s weights if they are the ones loaded under its name."""
        loaded = self._loaded.get(adapter.name)
        if loaded is not None and loaded[0] == adapter:
            del self._loaded[adapter.name]

    @contextmanager
    def active(self, adapter: Adapter | None) -> Iterator[None]:
        """Run the model under ``adapter`` (``None``: the base model) within this block.

        Raises:
            ValueError: ``adapter`` is no longer the registration loaded under its name.
        """
        if adapter is None:
            self._install(self._base)
            yield
            return
        loaded = self._loaded.get(adapter.name)
        if loaded is None or loaded[0] != adapter:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} was removed or re-registered while this request waited"
            )
        self._install(loaded[1])
        yield

    def _install(self, weights: WeightSet) -> None:
        if self._layout is not None and weights is not self._installed:
            self.model.update(tree_unflatten(weights))
            self._installed = weights
