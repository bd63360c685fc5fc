"""Serve ``import genlm.backend`` from genlm_backend, for code written against upstream genlm-backend.

Opt-in, nothing changes unless one of these is used:

* ``pytest -p genlm_backend.alias ...``: a pytest plugin that installs the alias
  before any conftest or test module is imported;
* ``python -m genlm_backend.alias script.py [args]`` or
  ``python -m genlm_backend.alias -m package.module [args]``: runs a script or
  module with the alias installed;
* :func:`install` from a launcher of your own, before the first ``genlm.backend`` import.

Once installed, ``genlm.backend`` and each submodule ``genlm.backend.X.Y`` are
the very module objects ``genlm_backend.X.Y`` (so ``genlm.backend.Token is
genlm_backend.Token``), even when upstream genlm-backend is installed as well:
the alias's finder is consulted before the path-based one. ``genlm`` itself stays
the namespace package shared with genlm-control and genlm-bytes; only when no
``genlm`` exists on ``sys.path`` is an empty namespace module provided.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types

UPSTREAM_NAME = "genlm.backend"
NAMESPACE_NAME = "genlm"
TARGET_NAME = "genlm_backend"


class AliasConflictError(ImportError):
    """Raised by :func:`install` when upstream's ``genlm.backend`` is already imported."""


def target_name(fullname: str) -> str | None:
    """The genlm_backend module serving ``fullname``, or ``None`` if the alias does not cover it.

    ``genlm.backend`` -> ``genlm_backend``; ``genlm.backend.llm.hf`` -> ``genlm_backend.llm.hf``.
    """
    if fullname == UPSTREAM_NAME:
        return TARGET_NAME
    if fullname.startswith(UPSTREAM_NAME + "."):
        return TARGET_NAME + fullname[len(UPSTREAM_NAME) :]
    return None


class _SameModuleLoader(importlib.abc.Loader):
    """Hands the import system an already-imported module instead of creating a new one."""

    def __init__(self, module: types.ModuleType):
        self.module = module
        self.original_spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        # The import system stamps the alias spec on the module; the module keeps its own.
        module.__spec__ = self.original_spec


class _NamespaceLoader(importlib.abc.Loader):
    """An empty ``genlm`` package, used only when no ``genlm`` is installed."""

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__path__ = []


class GenlmBackendAliasFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder mapping ``genlm.backend[.X.Y]`` to ``genlm_backend[.X.Y]``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == NAMESPACE_NAME:
            return self._namespace_spec()
        name = target_name(fullname)
        if name is None:
            return None
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(
                f"{fullname} has no counterpart in genlm_backend (looked for {name}); "
                "see the migration guide for upstream modules that are not provided",
                name=fullname,
            )
        module = importlib.import_module(name)
        return importlib.machinery.ModuleSpec(
            fullname, _SameModuleLoader(module), is_package=hasattr(module, "__path__")
        )

    def _namespace_spec(self):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(NAMESPACE_NAME, None)
            if spec is not None:
                return None  # an installed ``genlm`` namespace: let the import system use it
        return importlib.machinery.ModuleSpec(NAMESPACE_NAME, _NamespaceLoader(), is_package=True)


def _installed_finder() -> GenlmBackendAliasFinder | None:
    for finder in sys.meta_path:
        if isinstance(finder, GenlmBackendAliasFinder):
            return finder
    return None


def is_installed() -> bool:
    """Whether the alias finder is on ``sys.meta_path``."""
    return _installed_finder() is not None


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (idempotent).

    Raises:
        AliasConflictError: a ``genlm.backend`` module not served by genlm_backend
            (upstream's) was imported before; install the alias earlier.
    """
    for name, module in list(sys.modules.items()):
        wanted = target_name(name)
        if wanted is not None and module is not sys.modules.get(wanted):
            raise AliasConflictError(
                f"{name} is already imported from {getattr(module, '__file__', module)!r}; "
                "install the genlm_backend alias before anything imports genlm.backend"
            )
    if not is_installed():
        sys.meta_path.insert(0, GenlmBackendAliasFinder())


def uninstall() -> None:
    """Remove the finder and forget the ``genlm.backend`` names it served."""
    finder = _installed_finder()
    if finder is not None:
        sys.meta_path.remove(finder)
    for name in [name for name in sys.modules if target_name(name) is not None]:
        del sys.modules[name]


def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """pytest hook (``pytest -p genlm_backend.alias``): install before conftests are imported."""
    install()


USAGE = "usage: python -m genlm_backend.alias (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    """Run a script or a module (``-m``) with the alias installed, like ``python`` would.

    Raises:
        SystemExit: no script or module given.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv == ["-m"]:
        raise SystemExit(USAGE)
    install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    # The finder must live in genlm_backend.alias, not in this __main__ copy of it.
    from genlm_backend.alias import main as _main

    _main()
