"""The opt-in ``genlm.backend`` alias: each case runs in a fresh interpreter.

A fake upstream (``genlm/backend`` and ``genlm/control`` in a namespace
``genlm`` folder) stands in for an installed genlm-backend next to genlm-control.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

IDENTITY_CHECK = """
import genlm.backend, genlm_backend
from genlm.backend import Token, load_model_by_name
from genlm.backend.llm import MockAsyncLM
from genlm.backend.tokenization import decode_vocab
from genlm.backend.trie import AsyncTokenCharacterTrie
import genlm.backend.trie.base, genlm.backend.cache
import genlm_backend.llm, genlm_backend.trie.base, genlm_backend.cache
assert genlm.backend is genlm_backend
assert Token is genlm_backend.Token
assert MockAsyncLM is genlm_backend.llm.MockAsyncLM
assert decode_vocab is genlm_backend.tokenization.decode_vocab
assert AsyncTokenCharacterTrie is genlm_backend.trie.AsyncTokenCharacterTrie
assert genlm.backend.trie.base is genlm_backend.trie.base
assert genlm.backend.cache.OutputCache is genlm_backend.cache.OutputCache
assert genlm_backend.llm.__spec__.name == "genlm_backend.llm", genlm_backend.llm.__spec__
print("IDENTICAL")
"""


def _fake_upstream(root: Path) -> Path:
    """A ``genlm`` namespace holding a fake upstream ``backend`` and a ``control`` package."""
    for package, text in [("backend", "FAKE_UPSTREAM = True\n"), ("control", "CONTROL = True\n")]:
        folder = root / "genlm" / package
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text(text)
    return root


def _run(code: str, *args: str, extra_path: Path | None = None, cwd: Path = REPO_ROOT):
    path = [str(REPO_ROOT)] + ([str(extra_path)] if extra_path else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run(
        [sys.executable, *args] if args else [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def _script(tmp_path: Path, code: str) -> Path:
    script = tmp_path / "client_script.py"
    script.write_text(textwrap.dedent(code))
    return script


def test_alias_serves_genlm_backend_modules_as_themselves(tmp_path):
    script = _script(tmp_path, IDENTITY_CHECK)
    result = _run("", "-m", "genlm_backend.alias", str(script))
    assert result.returncode == 0, result.stderr
    assert "IDENTICAL" in result.stdout


def test_alias_takes_precedence_over_installed_upstream(tmp_path):
    upstream = _fake_upstream(tmp_path / "site")
    script = _script(
        tmp_path, IDENTITY_CHECK + "import genlm.control; assert genlm.control.CONTROL\n"
    )
    result = _run("", "-m", "genlm_backend.alias", str(script), extra_path=upstream)
    assert result.returncode == 0, result.stderr
    assert "IDENTICAL" in result.stdout


def test_without_opt_in_upstream_is_imported(tmp_path):
    upstream = _fake_upstream(tmp_path / "site")
    result = _run("import genlm.backend; print(genlm.backend.FAKE_UPSTREAM)", extra_path=upstream)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_without_opt_in_and_without_upstream_genlm_backend_is_missing():
    result = _run("import genlm.backend")
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr


def test_importing_genlm_backend_does_not_install_the_alias():
    code = "import genlm_backend, genlm_backend.llm, sys; print(any('Alias' in type(f).__name__ for f in sys.meta_path))"
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_module_mode_passes_arguments(tmp_path):
    package = tmp_path / "client_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "run.py").write_text(
        "import sys, genlm.backend, genlm_backend\n"
        "assert genlm.backend is genlm_backend\n"
        "print('ARGS', sys.argv[1:])\n"
    )
    result = _run("", "-m", "genlm_backend.alias", "-m", "client_pkg.run", "x", "--y", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ARGS ['x', '--y']" in result.stdout


def test_pytest_plugin_installs_before_conftest(tmp_path):
    upstream = _fake_upstream(tmp_path / "site")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from genlm.backend.tokenization import Token\n")
    (suite / "test_client.py").write_text(
        "import genlm.backend, genlm_backend\n"
        "from conftest import Token\n"
        "def test_served_by_genlm_backend():\n"
        "    assert genlm.backend is genlm_backend\n"
        "    assert Token is genlm_backend.Token\n"
    )
    args = ["-m", "pytest", "-p", "genlm_backend.alias", "-q", "-p", "no:cacheprovider", str(suite)]
    result = _run("", *args, extra_path=upstream, cwd=suite)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_missing_counterpart_is_a_clear_module_not_found_error():
    code = (
        "from genlm_backend.alias import install; install()\n"
        "try:\n    import genlm.backend.no_such_module\n"
        "except ModuleNotFoundError as exc:\n    print('NAME', exc.name); print(exc)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert "NAME genlm.backend.no_such_module" in result.stdout
    assert "genlm_backend.no_such_module" in result.stdout


def test_install_after_upstream_import_is_refused(tmp_path):
    upstream = _fake_upstream(tmp_path / "site")
    code = (
        "import genlm.backend\n"
        "from genlm_backend.alias import AliasConflictError, install\n"
        "try:\n    install()\n"
        "except AliasConflictError as exc:\n    print('REFUSED', exc)\n"
    )
    result = _run(code, extra_path=upstream)
    assert result.returncode == 0, result.stderr
    assert "REFUSED genlm.backend is already imported" in result.stdout


def test_install_is_idempotent_and_uninstall_restores_plain_imports():
    code = (
        "import sys\n"
        "from genlm_backend.alias import install, uninstall, is_installed\n"
        "install(); install()\n"
        "assert sum('Alias' in type(f).__name__ for f in sys.meta_path) == 1\n"
        "import genlm.backend\n"
        "uninstall()\n"
        "assert not is_installed() and 'genlm.backend' not in sys.modules\n"
        "try:\n    import genlm.backend\nexcept ModuleNotFoundError:\n    print('GONE')\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "GONE"


@pytest.mark.parametrize("argv", [[], ["-m"], ["--help"]])
def test_command_line_without_target_prints_usage(argv):
    result = _run("", "-m", "genlm_backend.alias", *argv)
    assert result.returncode != 0
    assert "usage: python -m genlm_backend.alias" in result.stderr


def test_upstream_only_backend_imports_but_raises_when_built():
    from genlm_backend import llm
    from genlm_backend.errors import BackendNotAvailableError

    backend = llm.AsyncSGLTransformer  # AsyncMlxLM is served: tests/test_mlx.py
    with pytest.raises(BackendNotAvailableError, match="use load_model_by_name"):
        backend.from_name("any-model")
    with pytest.raises(BackendNotAvailableError, match="genlm_backend has no"):
        backend(object())
