"""The fused Llama-family decoder against the plain transformers forward (``tests/hf_reference.py``).

Each family gets a small random model whose config exercises what differs
inside the family; norm weights and biases are drawn at random (transformers
initializes them to ones and zeros, which would hide a norm or bias applied to
the wrong tensor). A pass's attention is :class:`CausalCache`'s: every row has
the same length, keys and values are appended per layer, and SDPA with a
causal mask over past + new keys computes the output.

CI compiles one family (Qwen3: q/k norms, Q/K/V and o_proj biases, tied
embeddings, a head dimension other than hidden / heads: the most code paths in
one compile); ``-m fused_all`` compiles the others and SmolLM2-135M too.
Eager mode runs for every family in the default run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from genlm_backend.llm.hf.fused import SUPPORTED_ARCHITECTURES, FusedDecoder
from tests.hf_reference import ATOL, Reference

VOCAB = 1024
BF16_ATOL = 0.05
"""bfloat16 log-probabilities: the fused rows' distance from the float32 rows may exceed transformers' own bfloat16 forward's by this much at most."""


def build(family: str, dtype: torch.dtype = torch.float32):
    """A small random causal LM of ``family`` (see :data:`FAMILIES`), in ``dtype``."""
    import transformers

    class_name, options = FAMILIES[family]
    config_class = getattr(transformers, class_name.replace("ForCausalLM", "Config"))
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 192,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.1,  # rows far from uniform: a wrong layer moves them well past 1e-4
    }
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config_class(**{**shape, **options}))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
            elif "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
    return model.to(dtype).eval()


FAMILIES = {
    # Llama 3 shape, untied; MLP biases (a config option) cover the gate/up and down biases
    "llama": ("LlamaForCausalLM", {"tie_word_embeddings": False, "mlp_bias": True}),
    # Llama-3.1's rope scaling, tied embeddings (Llama-3.2, SmolLM2); the original
    # length is short so that the scaled frequencies turn within the test's positions
    "llama3.1": (
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": False}),  # Q/K/V biases, none on o_proj
    # q/k norms; Q/K/V and o_proj biases (a config option); tied; head_dim 48, not 128 / 4
    "qwen3": (
        "Qwen3ForCausalLM",
        {"tie_word_embeddings": True, "attention_bias": True, "head_dim": 48},
    ),
    # a sliding window wider than every context here: served as full attention
    "mistral": ("MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": 24}),
}
COMPILED_IN_CI = "qwen3"


class CausalCache:
    """A test ``attend``: keys and values appended per layer; SDPA, each new token seeing every key up to its own."""

    def __init__(self, scale: float):
        self.scale = scale
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, query, key, value) -> torch.Tensor:
        # query: [B, Hq, T, D]; key, value: [B, Hkv, T, D]
        if layer in self.keys:
            key = torch.cat([self.keys[layer], key], dim=2)
            value = torch.cat([self.values[layer], value], dim=2)
        self.keys[layer], self.values[layer] = key, value
        num_new, num_keys = query.shape[2], key.shape[2]
        # new token i sits at key position num_keys - num_new + i
        mask = torch.ones(num_new, num_keys, dtype=torch.bool).tril(num_keys - num_new)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return out.transpose(1, 2)  # [B, T, Hq, D]


def check_passes(decoder, reference: Reference, batch: int, length: int, atol: float) -> None:
    """A prefill of ``batch`` rows of ``length`` tokens read at several positions, three one-token
    steps read at the end, and a two-token step read at both tokens; every row against the reference."""
    generator = torch.Generator().manual_seed(batch * 100 + length)
    contexts = torch.randint(VOCAB, (batch, length), generator=generator)
    cache = CausalCache(decoder.scale)
    rows = torch.arange(batch).repeat_interleave(2)
    positions = torch.tensor([length - 1, 0] * batch)
    positions[1::4] = length // 2
    check(decoder, reference, cache, contexts, length, (rows, positions), atol)
    for num_new in (1, 1, 1, 2):
        new = torch.randint(VOCAB, (batch, num_new), generator=generator)
        contexts = torch.cat([contexts, new], dim=1)
        reads = None if num_new == 1 else (rows, torch.tensor([1, 0] * batch))
        check(decoder, reference, cache, contexts, num_new, reads, atol)


def check(decoder, reference, cache, contexts, num_new, reads, atol) -> None:
    batch, length = contexts.shape
    positions = torch.arange(length - num_new, length).expand(batch, -1).contiguous()
    logits = decoder(contexts[:, -num_new:].contiguous(), positions, cache.attend, reads)
    if reads is None:
        reads = (torch.arange(batch), torch.full((batch,), num_new - 1))
    expected = torch.stack(
        [
            reference.row(contexts[row, : length - num_new + position + 1].tolist())
            for row, position in zip(*(index.tolist() for index in reads))
        ]
    )
    assert logits.dtype == torch.float32 and logits.shape == (len(reads[0]), VOCAB)
    torch.testing.assert_close(torch.log_softmax(logits, dim=-1), expected, atol=atol, rtol=0)


@pytest.fixture(autouse=True)
def only_under_fused_all(request):
    """Tests marked ``fused_all`` run only when ``-m`` names the marker (CI compiles one family)."""
    selected = "fused_all" in (request.config.getoption("markexpr") or "")
    if request.node.get_closest_marker("fused_all") and not selected:
        pytest.skip("compiles one more family: run with -m fused_all (CI compiles qwen3 only)")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eager_rows_match_the_plain_forward(family):
    model = build(family)
    reference = Reference(model, VOCAB)
    decoder = FusedDecoder.of(model, compiled=False)
    check_passes(decoder, reference, batch=3, length=9, atol=ATOL)


COMPILED_CASES = [
    pytest.param(family, marks=() if family == COMPILED_IN_CI else pytest.mark.fused_all)
    for family in sorted(FAMILIES)
]


@pytest.mark.parametrize("family", COMPILED_CASES)
def test_compiled_rows_match_the_plain_forward_and_compile_once(family):
    model = build(family)
    reference = Reference(model, VOCAB)
    check_compiled(FusedDecoder.of(model), reference, atol=ATOL)


def check_compiled(decoder, reference, atol: float) -> None:
    """Rows within ``atol`` after one compile of each of the three functions, none later:
    other batch sizes and lengths (one token in one row included) run the same graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    check_passes(decoder, reference, batch=3, length=9, atol=atol)
    assert counters["stats"]["unique_graphs"] == 3  # first, between and last: nothing left eager
    assert not counters["graph_break"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        check_passes(decoder, reference, batch=1, length=1, atol=atol)
        check_passes(decoder, reference, batch=5, length=4, atol=atol)
    assert counters["stats"]["unique_graphs"] == 3
