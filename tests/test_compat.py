"""Engine internals are version-checked at construction, with an error naming what to install."""

from __future__ import annotations

import pytest
import torch

from genlm_backend.llm.hf.compat import check_transformers_version
from genlm_backend.llm.vllm.compat import check_vllm_version


def test_unsupported_transformers_is_a_clear_import_error():
    check_transformers_version("5.23.0")
    with pytest.raises(ImportError, match=r"transformers >=5,<6 .*found 4\.57\.1.*pip install"):
        check_transformers_version("4.57.1")


def test_unsupported_vllm_is_a_clear_import_error():
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.1+cpu")
    with pytest.raises(ImportError, match=r"vllm >=0\.32,<0\.34 .*found 0\.10\.2.*pip install"):
        check_vllm_version("0.10.2")
    with pytest.raises(ImportError, match=r"found 1\.0\.0"):
        check_vllm_version("1.0.0")


@pytest.mark.parametrize("kind", ["plain", "with sub-configs"])
def test_grouped_attention_switches_the_config_and_restores_it(kind):
    """The runner's attention is the config's while active (written where the config keeps
    it, or through transformers' setter for a config with sub-configs), ``sdpa`` after,
    also when the pass raises; a config on another implementation is left alone."""
    from transformers import Gemma3Config, LlamaConfig

    from genlm_backend.llm.hf.compat import _GROUPED_SDPA, grouped_kv_attention

    config = LlamaConfig() if kind == "plain" else Gemma3Config()
    config._attn_implementation = "sdpa"
    configs = [config, *(getattr(config, name) for name in config.sub_configs)]
    with grouped_kv_attention(config):
        assert [c._attn_implementation for c in configs] == [_GROUPED_SDPA] * len(configs)
    assert [c._attn_implementation for c in configs] == ["sdpa"] * len(configs)
    with pytest.raises(RuntimeError, match="the pass failed"), grouped_kv_attention(config):
        raise RuntimeError("the pass failed")
    assert [c._attn_implementation for c in configs] == ["sdpa"] * len(configs)
    config._attn_implementation = "eager"
    with grouped_kv_attention(config):
        assert config._attn_implementation == "eager"


class _Model(torch.nn.Module):
    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head = head

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


@pytest.mark.parametrize("shape", [(1, 1, 32), (5, 1, 32), (3, 4, 32), (64, 32)])
def test_a_vocabulary_major_head_gives_the_plain_heads_bits_and_is_restored(shape):
    """While active, a CPU float32 head without bias computes weight @ rows.T: the plain head's
    logits within rounding (MKL sums a few rows' products in another order: 5e-5 apart at
    most for 576-wide rows of unit normals), in the plain head's shape; the module's own
    forward after, also when the pass raises."""
    from genlm_backend.llm.hf.compat import head_vocabulary_major

    generator = torch.Generator().manual_seed(len(shape))
    head = torch.nn.Linear(32, 1000, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1000, 32, generator=generator))
    hidden = torch.randn(shape, generator=generator)
    model = _Model(head)
    with torch.inference_mode():
        expected = head(hidden)
        with head_vocabulary_major(model):
            assert "forward" in vars(head)
            logits = head(hidden)
        assert "forward" not in vars(head)
    assert logits.shape == expected.shape and logits.is_contiguous()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="a failing pass"), head_vocabulary_major(model):
        raise RuntimeError("a failing pass")
    assert "forward" not in vars(head)
    with head_vocabulary_major(model):  # another runner's pass over the model, within it
        with head_vocabulary_major(model):
            assert "forward" in vars(head)
        assert "forward" in vars(head)  # still the first pass's
        vars(head).pop("forward")  # a pass in another thread that replaced it too, ended
    assert "forward" not in vars(head)  # and this pass's end raised nothing


@pytest.mark.parametrize("num_rows", [1, 2, 7, 64])
def test_the_heads_product_in_blocks_matches_the_plain_head(num_rows):
    """A vocabulary of several blocks and a last partial one: every block lands in its columns
    of every row, within rounding of ``F.linear``; with gradients on, ``F.linear`` itself."""
    from genlm_backend.llm.hf.compat import _vocabulary_major_product

    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(1000, 48, generator=generator)
    hidden = torch.randn(num_rows, 1, 48, generator=generator)
    expected = torch.nn.functional.linear(hidden, weight)
    with torch.inference_mode():
        logits = _vocabulary_major_product(weight, hidden, block_rows=64)  # 15 blocks and 40
    assert logits.shape == (num_rows, 1, 1000) and logits.is_contiguous()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
    trained = weight.clone().requires_grad_()
    logits = _vocabulary_major_product(trained, hidden, block_rows=64)
    logits.sum().backward()  # the plain product: it records its gradient
    torch.testing.assert_close(trained.grad, hidden.reshape(-1, 48).sum(0).expand(1000, 48))


@pytest.mark.parametrize("kind", ["bias", "bfloat16", "not a Linear"])
def test_other_heads_are_left_alone(kind):
    from genlm_backend.llm.hf.compat import head_vocabulary_major

    if kind == "not a Linear":
        head: torch.nn.Module = torch.nn.Embedding(10, 4)
    else:
        head = torch.nn.Linear(4, 10, bias=kind == "bias")
        if kind == "bfloat16":
            head = head.to(torch.bfloat16)
    with head_vocabulary_major(_Model(head)):
        assert "forward" not in vars(head)
