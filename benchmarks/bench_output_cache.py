"""The output cache's share of a particle's call: a step's lookup (all misses) and store, per key.

As the engine uses it (``keep_views``, a 256 MiB budget grown into from 32
MiB): at each of ``--steps`` steps, 64 new requests are looked up
(``get_many``) and their rows stored as views of the step's ``[64, V]``
block (``put_rows``), blocks of 49,152 float32 columns in turns from a few
preallocated ones, so the cache evicts one block a step and remembers its
keys. Requests are made before the timing, hashed as the front makes them.
With ``--baseline-tree PATH``, that checkout's ``genlm_backend/cache/output.py``
is loaded beside this one and the two run in turns, ``--rounds`` times; the
median of each is printed.

    python benchmarks/bench_output_cache.py [--baseline-tree PATH] [--rounds 15]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NUM_ROWS = 64
VOCAB = 49152


def load_cache_class(tree: Path):
    """``OutputCache`` of ``tree``'s ``genlm_backend/cache/output.py``, loaded as a module of its own."""
    path = tree / "genlm_backend" / "cache" / "output.py"
    spec = importlib.util.spec_from_file_location(f"output_cache_of_{abs(hash(tree))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.OutputCache


def one_round(cache_class, steps) -> tuple[float, float]:
    """Nanoseconds a key of a step's lookup and of its store."""
    cache = cache_class(256 << 20, keep_views=True, initial_bytes=32 << 20)
    looked = stored = 0.0
    for keys, rows, block in steps:
        start = time.perf_counter()
        cache.get_many(keys)
        middle = time.perf_counter()
        cache.put_rows(keys, rows, block)
        looked += middle - start
        stored += time.perf_counter() - middle
    num_keys = len(steps) * NUM_ROWS
    return 1e9 * looked / num_keys, 1e9 * stored / num_keys


def main(argv=None) -> None:
    import torch

    from genlm_backend.llm.runner import Request

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    blocks = [torch.zeros(NUM_ROWS, VOCAB) for _ in range(6)]
    steps = []
    for step in range(args.steps):
        keys = [Request(None, (step, i), hashed=hash((step, i))) for i in range(NUM_ROWS)]
        block = blocks[step % len(blocks)]
        steps.append((keys, block.unbind(0), block))
    trees = {"this tree": REPO}
    if args.baseline_tree is not None:
        trees["baseline"] = args.baseline_tree
    classes = {name: load_cache_class(tree) for name, tree in trees.items()}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in classes}
    for _ in range(args.rounds):
        for name, cache_class in classes.items():
            results[name].append(one_round(cache_class, steps))
    print(
        f"{NUM_ROWS} new keys a step, {args.steps} steps; median of {args.rounds} rounds in turns"
    )
    print("| tree | lookup (ns a key) | store (ns a key) |")
    print("|---|---|---|")
    for name, values in results.items():
        lookup = statistics.median(v[0] for v in values)
        store = statistics.median(v[1] for v in values)
        print(f"| {name} | {lookup:.0f} | {store:.0f} |")


if __name__ == "__main__":
    main()
