"""Module layering: no two modules import each other; a backend is a folder the core reaches only by name.

Every import counts, wherever it stands (top level, inside a function, under
``TYPE_CHECKING``): a lazy import still makes each module depend on the other.
A package's ``__init__`` counts as the module named after the package.
"""

from __future__ import annotations

from tests.import_graph import (
    PACKAGE_DIR,
    module_name,
    package_imports,
    third_party_imports,
)


def test_no_two_modules_import_each_other():
    imports = package_imports()
    pairs = sorted(
        (a, b)
        for a, targets in imports.items()
        for b in targets
        if a < b and a in imports.get(b, ())
    )
    assert pairs == []
    assert len(imports) > 40  # the walk found the package's modules


BACKENDS = ("genlm_backend.llm.hf", "genlm_backend.llm.vllm", "genlm_backend.llm.mlx")
"""A backend is a folder: everything that knows its engine lives there."""

BACKEND_LIBRARIES = {
    "vllm": "genlm_backend.llm.vllm",
    "peft": "genlm_backend.llm.hf",
    "mlx": "genlm_backend.llm.mlx",
    "mlx_lm": "genlm_backend.llm.mlx",
}


def backend_of(module: str) -> str | None:
    return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)


def test_a_backend_library_is_imported_only_inside_its_backend_folder():
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module = module_name(path)
        for library in third_party_imports(path) & set(BACKEND_LIBRARIES):
            assert backend_of(module) == BACKEND_LIBRARIES[library], (module, library)


def test_backends_do_not_import_each_other():
    for module, targets in package_imports().items():
        mine = backend_of(module)
        for target in targets:
            theirs = backend_of(target)
            assert theirs is None or theirs == mine or mine is None, (module, target)


def test_the_core_knows_no_backend_except_where_one_is_chosen_by_name():
    """Above ``llm/``'s backend folders, a backend is imported only lazily, by the modules
    that build one by name (the loader, the package's lazy attributes, the command line)."""
    choosers = {"genlm_backend.llm", "genlm_backend.llm.loader", "genlm_backend.cli"}
    eager = package_imports(at_import_only=True)
    imports = package_imports()
    assert "genlm_backend.llm.hf" in imports["genlm_backend.llm.loader"]  # the walk sees them
    for module, targets in imports.items():
        if backend_of(module) is not None:
            continue
        backends = {backend_of(t) for t in targets} - {None}
        if backends:
            assert module in choosers, (module, backends)
            assert not {backend_of(t) for t in eager[module]} - {None}, module


LAYERS_BELOW = {
    "genlm_backend.cache": ("genlm_backend.llm", "genlm_backend.serve", "genlm_backend.trie"),
    "genlm_backend.tokenization": (
        "genlm_backend.llm",
        "genlm_backend.serve",
        "genlm_backend.trie",
    ),
    "genlm_backend.llm": ("genlm_backend.serve", "genlm_backend.trie", "genlm_backend.cli"),
    "genlm_backend.batching": (
        "genlm_backend.cache",
        "genlm_backend.llm",
        "genlm_backend.serve",
        "genlm_backend.trie",
    ),
    "genlm_backend.trie": ("genlm_backend.llm", "genlm_backend.serve", "genlm_backend.cli"),
}
"""A layer and the layers above it, which it never imports: the KV tree, its planner and the
output cache call no model; a backend (``RemoteLM`` included) knows no server; the batcher
knows no model, and the trie, which batches with it, no language model."""


def test_no_module_imports_a_layer_above_its_own():
    for module, targets in package_imports().items():
        for layer, above in LAYERS_BELOW.items():
            if module == layer or module.startswith(layer + "."):
                for target in targets:
                    assert not target.startswith(above), (module, target)


def test_the_client_of_a_server_is_a_backend_folder():
    imports = package_imports()
    assert "genlm_backend.llm.remote.model" in imports["genlm_backend.llm.loader"]
    assert not any(
        target.startswith("genlm_backend.serve")
        for module, targets in imports.items()
        if module.startswith("genlm_backend.llm.remote")
        for target in targets
    )
