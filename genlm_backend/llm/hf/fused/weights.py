"""A Llama-family model's weights, taken once in the fused layout: Q/K/V and gate/up concatenated.

:func:`take_weights` checks that a transformers causal LM is one the fused
decoder computes exactly (:data:`SUPPORTED_ARCHITECTURES`, plain ``nn.Linear``
projections, SwiGLU) and reads its weights. The concatenated matrices are the
only new tensors; with ``share_storage`` the model's own ``q_proj``/``k_proj``/
``v_proj`` and ``gate_proj``/``up_proj`` parameters are rebound to row slices of
them, so the model and the decoder hold one copy between them. Everything else
(embedding, head, norms, ``o_proj``, ``down_proj``) is the model's tensor itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
"""transformers classes the fused decoder serves (Llama 3.x and SmolLM2 are ``LlamaForCausalLM``)."""


class LayerWeights(NamedTuple):
    """One decoder layer's weights (``None``: the model has no such tensor).

    Shapes, with ``H`` the hidden size, ``I`` the MLP width, ``Hq``/``Hkv`` the
    query/key-value heads and ``D`` the head dimension:
    ``input_norm`` and ``post_norm`` ``[H]``; ``qkv`` ``[(Hq + 2 Hkv) D, H]``
    (rows: Q, then K, then V) and ``qkv_bias`` ``[(Hq + 2 Hkv) D]``; ``q_norm``
    and ``k_norm`` ``[D]`` (Qwen3); ``o`` ``[H, Hq D]``; ``gate_up`` ``[2 I, H]``
    (rows: gate, then up); ``down`` ``[H, I]``.
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(frozen=True)
class DecoderWeights:
    """A whole decoder's weights and the numbers its layers need.

    ``embed`` ``[V, H]`` and ``head`` ``[V, H]`` are the model's own tensors (one
    tensor when the embeddings are tied); ``final_norm`` ``[H]``. ``scale``: the
    attention's score scale (``D ** -0.5`` in every supported family). ``added_nbytes``:
    bytes of weights held here that the model does not also hold (0 with shared storage).
    """

    architecture: str
    layers: tuple[LayerWeights, ...]
    embed: torch.Tensor
    final_norm: torch.Tensor
    head: torch.Tensor
    head_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    eps: float
    added_nbytes: int


def check_supported(model) -> str:
    """The architecture name of ``model`` if the fused decoder serves it.

    Raises:
        ValueError: ``model`` is not one of :data:`SUPPORTED_ARCHITECTURES` (a peft
            wrapper included), or its activation is not SiLU.
    """
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        architectures = getattr(config, "architectures", None)
        raise ValueError(
            f"the fused decoder serves {', '.join(SUPPORTED_ARCHITECTURES)}; this model is "
            f"{name} (model_type {model_type!r}, architectures {architectures}). "
            "Other architectures run on the transformers executor."
        )
    activation = getattr(model.config, "hidden_act", None)
    if activation != "silu":
        raise ValueError(
            f"the fused decoder computes SwiGLU (silu); this {name} uses hidden_act={activation!r}"
        )
    return name


def take_weights(model, *, share_storage: bool = True) -> DecoderWeights:
    """The fused weights of ``model`` (see the module docstring for what is shared).

    Args:
        model: A transformers causal LM of :data:`SUPPORTED_ARCHITECTURES`, on the
            device and in the dtype it will run in.
        share_storage: Rebind the model's Q/K/V and gate/up parameters to slices of
            the concatenated matrices (same values, one copy). Anything that recorded
            their old addresses (a captured CUDA graph, a compiled graph with frozen
            weights) must be built after this call.

    Raises:
        ValueError: see :func:`check_supported`; or a projection is not a plain
            ``torch.nn.Linear`` (a quantized layer, a peft LoRA layer).
    """
    architecture = check_supported(model)
    config = model.config
    decoder = model.model
    attention = decoder.layers[0].self_attn
    layers = tuple(_layer_weights(layer, share_storage) for layer in decoder.layers)
    head = _linear(model.get_output_embeddings(), "lm_head")
    fused = [tensor for layer in layers for tensor in (layer.qkv, layer.gate_up)]
    fused += [t for layer in layers for t in (layer.qkv_bias, layer.gate_up_bias) if t is not None]
    return DecoderWeights(
        architecture=architecture,
        layers=layers,
        embed=decoder.embed_tokens.weight.detach(),
        final_norm=decoder.norm.weight.detach(),
        head=head.weight.detach(),
        head_bias=_detached(head.bias),
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=attention.head_dim,
        scale=attention.scaling,
        eps=config.rms_norm_eps,
        added_nbytes=0 if share_storage else sum(t.numel() * t.element_size() for t in fused),
    )


def _layer_weights(layer, share_storage: bool) -> LayerWeights:
    attention, mlp = layer.self_attn, layer.mlp
    q, k, v = (_linear(getattr(attention, name), name) for name in ("q_proj", "k_proj", "v_proj"))
    gate, up = _linear(mlp.gate_proj, "gate_proj"), _linear(mlp.up_proj, "up_proj")
    o, down = _linear(attention.o_proj, "o_proj"), _linear(mlp.down_proj, "down_proj")
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=_concatenated([q.weight, k.weight, v.weight], share_storage),
        qkv_bias=_concatenated_biases([q.bias, k.bias, v.bias], share_storage),
        q_norm=None if q_norm is None else q_norm.weight.detach(),
        k_norm=None if k_norm is None else k_norm.weight.detach(),
        o=o.weight.detach(),
        o_bias=_detached(o.bias),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=_concatenated([gate.weight, up.weight], share_storage),
        gate_up_bias=_concatenated_biases([gate.bias, up.bias], share_storage),
        down=down.weight.detach(),
        down_bias=_detached(down.bias),
    )


def _linear(module, name: str) -> torch.nn.Linear:
    if type(module) is not torch.nn.Linear:
        raise ValueError(
            f"the fused decoder reads plain torch.nn.Linear weights; {name} is "
            f"{type(module).__module__}.{type(module).__name__} (quantized or adapted layers "
            "run on the transformers executor)"
        )
    return module


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def _concatenated_biases(biases: list, share_storage: bool) -> torch.Tensor | None:
    """The biases concatenated; ``None`` if none of the projections has one."""
    if all(bias is None for bias in biases):
        return None
    if any(bias is None for bias in biases):
        raise ValueError(
            "the fused decoder needs biases on all or none of the projections it concatenates; "
            f"this model has {sum(bias is not None for bias in biases)} of {len(biases)}"
        )
    return _concatenated(biases, share_storage)


def _concatenated(parameters: list[torch.Tensor], share_storage: bool) -> torch.Tensor:
    """``parameters`` concatenated along dim 0; with ``share_storage`` each parameter becomes a view of the result.

    The old storage is freed as each parameter is rebound, so building the fused
    weights of a whole model needs one layer's worth of extra memory at a time.
    """
    with torch.no_grad():
        fused = torch.cat([parameter.detach() for parameter in parameters])
        if share_storage:
            start = 0
            for parameter in parameters:
                rows = parameter.shape[0]
                parameter.data = fused[start : start + rows]
                start += rows
    return fused
