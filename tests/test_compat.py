"""Engine internals are version-checked at construction, with an error naming what to install."""

from __future__ import annotations

import pytest

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
