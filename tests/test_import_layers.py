"""Module layering: no two modules of the package import each other.

Every import counts, wherever it stands (top level, inside a function, under
``TYPE_CHECKING``): a lazy import still makes each module depend on the other.
A package's ``__init__`` counts as the module named after the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import genlm_backend

PACKAGE_DIR = Path(genlm_backend.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b``: ``a.b`` if that
    is a module, else ``a``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        found.update(target for target in targets if target in modules)
    return found - {name}


def test_no_two_modules_import_each_other():
    paths = sorted(PACKAGE_DIR.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    imports = {module_name(path): imported_modules(path, modules) for path in paths}
    pairs = sorted(
        (a, b)
        for a, targets in imports.items()
        for b in targets
        if a < b and a in imports.get(b, ())
    )
    assert pairs == []
    assert len(imports) > 40  # the walk found the package's modules
