"""The fused decoder's computations between two attention calls, as plain functions of tensors.

Every tensor here is token-major and flat over the batch: ``N = B * T`` tokens,
so one compiled graph serves every batch size and length (see
:mod:`~genlm_backend.llm.hf.fused.decoder`). The arithmetic follows
transformers' Llama-family modules operation by operation (float32 norms cast
back before the weight, rotary as ``x cos + rotate_half(x) sin``), so eager
results match the model's own forward to rounding.

Shapes: ``H`` hidden size, ``Hq``/``Hkv`` query/key-value heads, ``D`` head
dimension, ``V`` vocabulary, ``R`` rows read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from genlm_backend.llm.hf.fused.weights import LayerWeights


class LayerSpec(NamedTuple):
    """The constants of every layer: heads, the norms' epsilon, and how the MLP multiplies.

    ``split_gate_up``: the gate and up products as two matrix products over the
    halves of the concatenated matrix instead of one. On the CPU one ``[2 I, H]``
    product took 10 to 25% longer than two ``[I, H]`` ones (MKL, SmolLM2's shapes;
    BENCHMARKS.md, "The fused decoder on the CPU"); on a GPU one product is one
    kernel fewer.
    """

    num_heads: int
    num_kv_heads: int
    eps: float
    split_gate_up: bool


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as ``LlamaRMSNorm``: in float32, cast back to ``x``'s dtype, then scaled."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + update, rms_norm(residual + update))``: the residual add and the next norm in one pass."""
    total = residual + update
    return total, rms_norm(total, weight, eps)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of queries ``[N, Hq, D]`` and keys ``[N, Hkv, D]`` by ``cos``/``sin`` ``[N, D]``.

    ``cos``/``sin`` come from the model's own rotary module (every rope type and
    scaling is its business); this only rotates: ``x cos + rotate_half(x) sin``.
    """
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the concatenated gate/up product ``[N, 2 I]`` -> ``[N, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def attention_inputs(
    normed: torch.Tensor,
    layer: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    spec: LayerSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``[N, Hq, D]``, keys and values ``[N, Hkv, D]`` of normed hidden states ``[N, H]``.

    One matrix product for Q, K and V; Qwen3's per-head q/k norms before the rotary.
    """
    qkv = F.linear(normed, layer.qkv, layer.qkv_bias)
    head_dim = cos.shape[-1]
    kv_width = spec.num_kv_heads * head_dim
    q, k, v = qkv.split([spec.num_heads * head_dim, kv_width, kv_width], dim=-1)
    q, k, v = (x.unflatten(-1, (-1, head_dim)) for x in (q, k, v))
    if layer.q_norm is not None and layer.k_norm is not None:
        q, k = rms_norm(q, layer.q_norm, spec.eps), rms_norm(k, layer.k_norm, spec.eps)
    q, k = apply_rotary(q, k, cos, sin)
    return q, k, v


def mlp_block(
    attention_out: torch.Tensor, residual: torch.Tensor, layer: LayerWeights, spec: LayerSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual after attention, MLP output)`` of attention output ``[N, Hq D]`` and the residual ``[N, H]``.

    The MLP's own residual add is left to the caller, fused with the norm that follows.
    """
    update = F.linear(attention_out, layer.o, layer.o_bias)
    residual, normed = add_rms_norm(residual, update, layer.post_norm, spec.eps)
    return residual, F.linear(gated(normed, layer, spec), layer.down, layer.down_bias)


def gated(normed: torch.Tensor, layer: LayerWeights, spec: LayerSpec) -> torch.Tensor:
    """``silu(gate) * up`` ``[N, I]`` of normed hidden states ``[N, H]``, in one matrix product or
    two over the halves of the concatenated matrix (:attr:`LayerSpec.split_gate_up`)."""
    if not spec.split_gate_up:
        return swiglu(F.linear(normed, layer.gate_up, layer.gate_up_bias))
    weights = layer.gate_up.chunk(2)
    biases = (None, None) if layer.gate_up_bias is None else layer.gate_up_bias.chunk(2)
    gate, up = (F.linear(normed, weight, bias) for weight, bias in zip(weights, biases))
    return F.silu(gate) * up


def first_layer(
    input_ids: torch.Tensor,
    embed: torch.Tensor,
    layer: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    spec: LayerSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids ``[N]`` -> layer 0's ``(q, k, v, residual)``: embedding, norm, QKV, rotary."""
    hidden = F.embedding(input_ids, embed)
    normed = rms_norm(hidden, layer.input_norm, spec.eps)
    return (*attention_inputs(normed, layer, cos, sin, spec), hidden)


def between_layers(
    attention_out: torch.Tensor,
    residual: torch.Tensor,
    layer: LayerWeights,
    next_layer: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    spec: LayerSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything between two attention calls: ``layer``'s ``o_proj``, residual, norm, MLP and
    residual, then ``next_layer``'s norm, QKV and rotary -> ``(q, k, v, residual)``."""
    residual, update = mlp_block(attention_out, residual, layer, spec)
    hidden, normed = add_rms_norm(residual, update, next_layer.input_norm, spec.eps)
    return (*attention_inputs(normed, next_layer, cos, sin, spec), hidden)


def last_layer_logits(
    attention_out: torch.Tensor,
    residual: torch.Tensor,
    reads: torch.Tensor,
    layer: LayerWeights,
    final_norm: torch.Tensor,
    head: torch.Tensor,
    head_bias: torch.Tensor | None,
    spec: LayerSpec,
) -> torch.Tensor:
    """Float32 logits ``[R, V]`` at the flat token indices ``reads`` ``[R]``.

    Only the read tokens go through the last layer's MLP, the final norm and the
    head: the last layer's keys and values are already written, so no other token's
    hidden state is needed past its attention.
    """
    attention_out, residual = attention_out.index_select(0, reads), residual.index_select(0, reads)
    residual, update = mlp_block(attention_out, residual, layer, spec)
    _, normed = add_rms_norm(residual, update, final_norm, spec.eps)
    return F.linear(normed, head, head_bias).float()
