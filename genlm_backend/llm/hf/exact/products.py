"""Matrix products whose rows do not depend on the other rows: projections padded to
:data:`~genlm_backend.llm.hf.exact.numerics.MIN_ROWS` rows (CPU) or computed in pieces of
:data:`~genlm_backend.llm.hf.exact.numerics.CUDA_ROWS` rows (CUDA)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from genlm_backend.llm.hf.exact.numerics import CUDA_ROWS, MIN_ROWS, pad_rows


class PaddedMatmuls:
    """While :attr:`active`, every projection of ``model`` (``nn.Linear``, transformers' ``Conv1D``)
    computes a row with products whose shape does not depend on the other rows.

    On the CPU a product of fewer than :data:`MIN_ROWS` rows is padded with
    zeros to that many (the extra outputs dropped). With ``pieces`` (on CUDA),
    a plain ``nn.Linear`` or ``Conv1D`` computes its rows in pieces of exactly
    :data:`CUDA_ROWS` rows: the module itself is handed no rows, and its output
    is the pieces' products.

    The hooks stay on the modules; :meth:`attach` puts them on modules added since (an adapter's).
    One per model (:meth:`of`), however many runners it serves.
    """

    def __init__(self, pieces: bool = False):
        self.active = False
        self.pieces = pieces
        self.device: str | None = None
        """The device type of the model's weights when :meth:`of` last looked."""
        self._hooked: set[int] = set()
        self._shapes: dict[int, torch.Size] = {}
        self._inputs: dict[int, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = {}

    @classmethod
    def of(cls, model: torch.nn.Module) -> PaddedMatmuls:
        """The model's own, its projections hooked (products in pieces where its weights are on CUDA)."""
        device = next(model.parameters()).device.type
        padded = _PADDED.get(model)
        if padded is None:
            padded = _PADDED[model] = cls(pieces=device == "cuda")
        if padded.device != device:  # made here, or the model moved since
            padded.device, padded.pieces = device, device == "cuda"
        padded.attach(model)
        return padded

    def attach(self, model: torch.nn.Module) -> None:
        """Hook the projections of ``model`` not hooked yet.

        Raises:
            ValueError: with ``pieces``, a projection whose product is not a plain
                ``nn.Linear``'s or ``Conv1D``'s (a quantized layer, say).
        """
        projections = [module for module in model.modules() if _is_projection(module)]
        for module in projections if self.pieces else ():
            if _product_of(module) is None:
                raise ValueError(
                    f"deterministic=True on CUDA computes projections in pieces, which needs plain "
                    f"nn.Linear or Conv1D layers; this model has a {type(module).__name__}"
                )
        for module in projections:
            if id(module) in self._hooked:
                continue
            module.register_forward_pre_hook(self._pad)
            module.register_forward_hook(self._unpad)
            self._hooked.add(id(module))

    def _pad(self, module, args):
        if not self.active:
            return None
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        self._shapes.pop(id(module), None)  # left by a pass that raised
        self._inputs.pop(id(module), None)
        product = _product_of(module) if self.pieces else None
        if product is not None:
            self._shapes[id(module)] = x.shape
            self._inputs[id(module)] = (product, rows)
            return (rows[:0], *args[1:])
        if rows.shape[0] >= MIN_ROWS:
            return None
        self._shapes[id(module)] = x.shape
        return (pad_rows(rows), *args[1:])

    def _unpad(self, module, args, output):
        shape = self._shapes.pop(id(module), None)
        if shape is None:
            return None
        pending = self._inputs.pop(id(module), None)
        num_rows = shape[:-1].numel()
        if pending is not None:
            output = products_in_pieces(*pending)
        return output[:num_rows].reshape(*shape[:-1], output.shape[-1])


def products_in_pieces(product, rows: torch.Tensor) -> torch.Tensor:
    """``product(rows)`` computed :data:`CUDA_ROWS` rows at a time (the last piece padded with zeros)."""
    num_rows = rows.shape[0]
    if num_rows == 0:
        return product(rows)
    padded = -(-num_rows // CUDA_ROWS) * CUDA_ROWS
    if padded != num_rows:
        rows = torch.cat([rows, rows.new_zeros(padded - num_rows, rows.shape[1])])
    if padded == CUDA_ROWS:  # a step of up to CUDA_ROWS rows: one product, no copy
        return product(rows)[:num_rows]
    return torch.cat([product(piece) for piece in rows.split(CUDA_ROWS)])[:num_rows]


def _product_of(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The product a plain projection computes, as a function of its input rows (``None`` for others)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if type(module) is torch.nn.Linear and isinstance(weight, torch.Tensor):
        return lambda rows: torch.nn.functional.linear(rows, weight, bias)
    if type(module).__name__ != "Conv1D" or not isinstance(weight, torch.Tensor):
        return None
    if isinstance(bias, torch.Tensor) and weight.dim() == 2:
        return lambda rows: torch.addmm(bias, rows, weight)
    return None


_PADDED: weakref.WeakKeyDictionary[torch.nn.Module, PaddedMatmuls] = weakref.WeakKeyDictionary()


def _is_projection(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
