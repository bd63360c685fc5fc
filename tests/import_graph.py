"""The package's import graph, read from its source with ``ast``: which modules import which.

Every import counts, wherever it stands (top level, inside a function, under
``TYPE_CHECKING``), unless ``at_import_only`` asks for those that run when the
module is imported. A package's ``__init__`` counts as the module named after the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import genlm_backend

PACKAGE_DIR = Path(genlm_backend.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(path: Path, at_import_only: bool = False) -> list[ast.stmt]:
    """Every import statement of ``path``; with ``at_import_only`` only those that run
    when the module is imported (not in a function body, not under ``TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if not at_import_only:
        return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    found: list[ast.stmt] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(path: Path, modules: set[str], at_import_only: bool = False) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b``: ``a.b`` if that
    is a module, else ``a``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in import_statements(path, at_import_only):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            assert isinstance(node, ast.ImportFrom)
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        found.update(target for target in targets if target in modules)
    return found - {name}


def third_party_imports(path: Path, at_import_only: bool = False) -> set[str]:
    """Top-level names of the absolute imports of ``path`` (``transformers``, ``torch``, ...)."""
    names = set()
    for node in import_statements(path, at_import_only):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def package_imports(at_import_only: bool = False) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    paths = sorted(PACKAGE_DIR.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules, at_import_only) for path in paths}


def module_path(module: str) -> Path:
    """The file of a module of the package (its ``__init__.py`` for a subpackage)."""
    file = PACKAGE_DIR.parent / (module.replace(".", "/") + ".py")
    return file if file.exists() else file.with_suffix("") / "__init__.py"
