"""Fused Llama-family decoder layers: weights taken once, norms/rotary/SwiGLU fused, compiled.

:class:`FusedDecoder` runs a transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` or ``MistralForCausalLM`` with the caller's attention
(:data:`Attend`) between its layers.
"""

from genlm_backend.llm.hf.fused.decoder import Attend, FusedDecoder
from genlm_backend.llm.hf.fused.weights import SUPPORTED_ARCHITECTURES

__all__ = ["SUPPORTED_ARCHITECTURES", "Attend", "FusedDecoder"]
