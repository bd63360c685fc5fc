"""The fused Llama-family decoder: the model's layers as three compiled functions around the caller's attention.

A forward pass is ``first_layer``, then ``between_layers`` once per pair of
adjacent layers, then ``last_layer_logits`` (:mod:`~genlm_backend.llm.hf.fused.layers`),
with the caller's ``attend`` between each two: attention and the key/value
cache stay outside, so any cache layout, mask or level structure plugs in.

Compiled mode wraps each of the three in ``torch.compile(fullgraph=True)``
(default mode: no CUDA graphs inside, so a caller may capture around it). Their
inputs are flat over the batch (``N = B * T`` tokens) and the token and read
counts are marked unbacked, so one graph per function serves every batch size
and length, 1 included: a pass of new shape never recompiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from genlm_backend.llm.hf.fused.layers import (
    LayerSpec,
    between_layers,
    first_layer,
    last_layer_logits,
)
from genlm_backend.llm.hf.fused.weights import DecoderWeights, take_weights

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer_index, query, key, value) -> output``: the caller's attention for one layer.

``query`` ``[B, Hq, T, D]``, ``key`` and ``value`` ``[B, Hkv, T, D]``: the pass's
new tokens only, rotary applied, in the model's dtype, views that need not be
contiguous. ``attend`` stores the new keys/values wherever the caller keeps its
cache and returns softmax attention of the queries over past and new keys
(scale :attr:`FusedDecoder.scale`, the caller's mask) as ``[B, T, Hq, D]`` (what
transformers' attention functions return) or ``[B, T, Hq * D]``, contiguous or not.
"""


class FusedDecoder:
    """A Llama-family causal LM as fused, optionally compiled, layers (build with :meth:`of`).

    Attributes:
        architecture: The transformers class it was built from.
        num_layers, num_heads, num_kv_heads, head_dim: The decoder's shape.
        scale: The attention's score scale ``attend`` must use.
        vocab_size: Rows of the output head (the model's vocabulary, before any cut).
        attention_window: The narrowest sliding window of any layer (``None``: none).
            ``attend`` is expected to attend over every past key, so contexts must stay
            within it, as ``AsyncTransformer``'s ``max_context_length`` already ensures.
        added_nbytes: Weight bytes the decoder holds beyond the model's (0 when the
            storage is shared).
        compiled: Whether the layers run through ``torch.compile``.
        spec: The layers' constants (:class:`~genlm_backend.llm.hf.fused.layers.LayerSpec`);
            ``split_gate_up`` defaults to whether the weights are on the CPU.
    """

    def __init__(
        self,
        weights: DecoderWeights,
        rotary: torch.nn.Module,
        *,
        attention_window: int | None = None,
        compiled: bool = True,
        split_gate_up: bool | None = None,
    ):
        self.weights = weights
        self._rotary = rotary
        self.architecture = weights.architecture
        self.num_layers = len(weights.layers)
        self.num_heads, self.num_kv_heads = weights.num_heads, weights.num_kv_heads
        self.head_dim, self.scale = weights.head_dim, weights.scale
        self.vocab_size = weights.head.shape[0]
        self.attention_window = attention_window
        self.added_nbytes = weights.added_nbytes
        self.compiled = compiled
        if split_gate_up is None:
            split_gate_up = weights.embed.device.type == "cpu"
        self.spec = LayerSpec(self.num_heads, self.num_kv_heads, weights.eps, split_gate_up)
        functions: tuple[Callable[..., Any], ...] = (first_layer, between_layers, last_layer_logits)
        if compiled:
            functions = tuple(torch.compile(f, fullgraph=True) for f in functions)
        self._first, self._between, self._last = functions

    @classmethod
    def of(
        cls,
        model,
        *,
        compiled: bool = True,
        share_storage: bool = True,
        split_gate_up: bool | None = None,
    ) -> FusedDecoder:
        """The fused decoder of a transformers causal LM, its weights taken once.

        Args:
            model: A ``LlamaForCausalLM`` (Llama 3.x, SmolLM2), ``Qwen2ForCausalLM``,
                ``Qwen3ForCausalLM`` or ``MistralForCausalLM``, on the device and in
                the dtype it will run in, without adapters.
            compiled: Run the layers through ``torch.compile``; ``False``: eagerly.
            share_storage: See :func:`~genlm_backend.llm.hf.fused.weights.take_weights`.
            split_gate_up: See :class:`~genlm_backend.llm.hf.fused.layers.LayerSpec`
                (``None``: split on the CPU).

        Raises:
            ValueError: any other architecture (the message names it and the
                supported ones), an activation other than SiLU, or a projection that
                is not a plain ``torch.nn.Linear``.
        """
        from genlm_backend.llm.hf.compat import attention_window

        weights = take_weights(model, share_storage=share_storage)
        window = attention_window(model.config)
        return cls(
            weights,
            model.model.rotary_emb,
            attention_window=window,
            compiled=compiled,
            split_gate_up=split_gate_up,
        )

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attend: Attend,
        reads: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Float32 logits ``[R, V]`` of a pass of ``T`` new tokens in each of ``B`` rows.

        Args:
            input_ids: ``[B, T]`` int64, on the weights' device.
            position_ids: ``[B, T]`` int64: each new token's position in its context.
            attend: The caller's attention (see :data:`Attend`), called once per layer
                in order, ``layer_index`` 0 to ``num_layers - 1``.
            reads: ``(rows, positions)``, two ``[R]`` int64 tensors: the logits
                returned are those of the new tokens ``(rows[i], positions[i])``, in
                that order. ``None``: the last new token of every row (``R = B``).
                Their values are not checked against ``B`` and ``T`` (that would wait
                for the device): an index out of range fails in the indexing kernel.

        Raises:
            ValueError: the inputs' shapes, dtypes or device are not as above, or
                ``attend`` returned a tensor of another shape.
        """
        batch, length = self._check(input_ids, position_ids, reads)
        cos, sin = self._rotary(self.weights.embed, position_ids)  # [B, T, D] each
        cos, sin = cos.reshape(-1, self.head_dim), sin.reshape(-1, self.head_dim)
        tokens = _graph_input(input_ids.reshape(-1))
        flat_reads = self._flat_reads(reads, batch, length, input_ids.device)
        layers = self.weights.layers
        self._mark_tokens(tokens, cos, sin)
        spec = self.spec
        q, k, v, residual = self._first(tokens, self.weights.embed, layers[0], cos, sin, spec)
        for index, layer in enumerate(layers):
            # q: [N, Hq, D] -> [B, Hq, T, D]; k, v: [N, Hkv, D] -> [B, Hkv, T, D]
            q, k, v = (x.unflatten(0, (batch, length)).transpose(1, 2) for x in (q, k, v))
            out = self._attention_output(attend(index, q, k, v), batch, length)  # [N, Hq D]
            self._mark_tokens(out, residual)
            if index + 1 < self.num_layers:
                next_layer = layers[index + 1]
                q, k, v, residual = self._between(out, residual, layer, next_layer, cos, sin, spec)
        self._mark_reads(flat_reads)
        weights = self.weights
        head = (weights.final_norm, weights.head, weights.head_bias)
        return self._last(out, residual, flat_reads, layer, *head, spec)

    def _check(self, input_ids, position_ids, reads) -> tuple[int, int]:
        """``(B, T)`` of well-formed inputs (see :meth:`__call__`'s ``Raises``)."""
        device = self.weights.embed.device
        for name, ids in (("input_ids", input_ids), ("position_ids", position_ids)):
            _check_index(ids, 2, f"{name} must be a [B, T] int64 tensor")
            if ids.device != device:
                raise ValueError(f"{name} is on {ids.device}; the weights are on {device}")
        if position_ids.shape != input_ids.shape or input_ids.numel() == 0:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} "
                "must have one non-empty shape"
            )
        if reads is not None:
            rows, positions = reads
            _check_index(rows, 1, "reads' rows must be an [R] int64 tensor")
            _check_index(positions, 1, "reads' positions must be an [R] int64 tensor")
            if rows.shape != positions.shape or rows.numel() == 0 or rows.device != device:
                raise ValueError(
                    f"reads must be two non-empty [R] tensors of one length on {device}, got "
                    f"{_describe(rows)} and {_describe(positions)}"
                )
        return input_ids.shape[0], input_ids.shape[1]

    @staticmethod
    def _flat_reads(reads, batch: int, length: int, device: torch.device) -> torch.Tensor:
        """Flat token indices ``[R]`` (``row * T + position``) of the tokens whose logits are returned."""
        if reads is None:
            return torch.arange(1, batch + 1, device=device) * length - 1
        rows, positions = reads
        return _graph_input(rows * length + positions)

    def _attention_output(self, out, batch: int, length: int) -> torch.Tensor:
        width = self.num_heads * self.head_dim
        if (
            not isinstance(out, torch.Tensor)
            or tuple(out.shape[:2]) != (batch, length)
            or out.numel() != batch * length * width
        ):
            raise ValueError(
                f"attend must return [B, T, Hq, D] or [B, T, Hq * D] = [{batch}, {length}, "
                f"{self.num_heads}, {self.head_dim}]; it returned {_describe(out)}"
            )
        return _graph_input(out.reshape(batch * length, width))

    def _mark_tokens(self, *tensors: torch.Tensor) -> None:
        if self.compiled:
            for tensor in tensors:
                torch._dynamo.decorators.mark_unbacked(tensor, 0, shape_id="tokens")

    def _mark_reads(self, reads: torch.Tensor) -> None:
        if self.compiled:
            torch._dynamo.decorators.mark_unbacked(reads, 0, shape_id="reads")


def _graph_input(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous inference tensor, copied if it is not one.

    Dynamo guards on its inputs' strides and dispatch keys: a slice of longer rows,
    or a tensor made outside inference mode, would recompile every function.
    """
    if tensor.is_contiguous() and tensor.is_inference():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _check_index(value, dim: int, requirement: str) -> None:
    if not isinstance(value, torch.Tensor) or value.dim() != dim or value.dtype != torch.int64:
        raise ValueError(f"{requirement}, got {_describe(value)}")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return f"{type(value).__name__}"
