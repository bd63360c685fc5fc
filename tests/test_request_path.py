"""A request's path is one loop a reader can follow: the modules one particle step runs.

Eight particles each await the row of a context that extends an already
computed one by a token (transformers backend, CPU, after a warm-up step), as
``shared/tools/path_modules.py`` does with the default model; every module of
the package whose functions are entered, in any thread, is counted.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import genlm_backend
from genlm_backend.llm.hf import AsyncTransformer
from tests.conftest import build_tiny_llama

ROOT = os.path.dirname(genlm_backend.__file__)

PATH = {
    "llm/base.py",
    "batching.py",
    "llm/engine.py",
    "llm/runner.py",
    "llm/hf/runner.py",
    "llm/hf/compat.py",
    "cache/plan.py",
    "cache/kv_tree.py",
    "cache/kv_block.py",
    "cache/output.py",
}
"""The ten modules: the front, the batcher, the engine, the runner seam with the prefix-cache
driver, the transformers runner with its executor and its internals, the planner, the KV
tree and its blocks (whose module also makes a pass's int lists tensors), the output cache."""


def modules_of_one_step() -> set[str]:
    llm = AsyncTransformer(build_tiny_llama(256), None, byte_vocab=[bytes([i]) for i in range(256)])
    prompt = list(range(100, 140))
    contexts = [[*prompt, 200 + i] for i in range(8)]
    seen: set[str] = set()
    profiling = threading.Event()

    def profile(frame, event, arg):
        if profiling.is_set() and event == "call" and frame.f_code.co_filename.startswith(ROOT):
            seen.add(os.path.relpath(frame.f_code.co_filename, ROOT))

    async def step(batch):
        return await asyncio.gather(*(llm.next_token_logprobs(c) for c in batch))

    async def main():
        await step(contexts)  # the prompt and the first tokens computed
        following = [[*c, 7] for c in contexts]
        profiling.set()
        sys.setprofile(profile)
        try:
            await step(following)
        finally:
            sys.setprofile(None)
            profiling.clear()

    threading.setprofile(profile)
    try:
        asyncio.run(main())
    finally:
        threading.setprofile(None)
        llm.close()
    return seen


def test_a_particle_step_runs_code_in_ten_modules():
    assert modules_of_one_step() == PATH


def test_a_default_step_imports_nothing_of_deterministic_mode():
    """Exact rows are a package of their own, imported only by a runner asked for them."""
    script = (
        "import asyncio, sys\n"
        "from genlm_backend.llm.hf import AsyncTransformer\n"
        "from tests.conftest import build_tiny_llama\n"
        "llm = AsyncTransformer(build_tiny_llama(256), None, "
        "byte_vocab=[bytes([i]) for i in range(256)])\n"
        "asyncio.run(llm.next_token_logprobs([1, 2, 3]))\n"
        "print(sorted(m for m in sys.modules if m.startswith('genlm_backend.llm.hf.exact')))\n"
    )
    root = os.path.dirname(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


def test_a_particle_step_reads_no_context_whole(monkeypatch):
    """Behind a 300-token prompt, a step of particles finds each context's node in the KV tree
    by its parent's identity (the tuple the front validated one step before): no key compares
    two different tuples of tokens, each such comparison a whole context read."""
    from genlm_backend.cache.kv_tree import ContextKey

    compared: list[int] = []
    original = ContextKey.__eq__

    def eq(self, other):
        if isinstance(other, ContextKey) and self.tokens is not other.tokens:
            compared.append(len(self.tokens))
        return original(self, other)

    monkeypatch.setattr(ContextKey, "__eq__", eq)
    llm = AsyncTransformer(build_tiny_llama(256), None, byte_vocab=[bytes([i]) for i in range(256)])
    prompt = [(5 * i + 2) % 256 for i in range(300)]

    async def main() -> None:
        particles = [[*prompt, i] for i in range(8)]
        await asyncio.gather(*map(llm.next_token_logprobs, particles))
        compared.clear()
        for step in range(3):
            particles = [[*particle, step + 9] for particle in particles]
            await asyncio.gather(*map(llm.next_token_logprobs, particles))

    asyncio.run(main())
    llm.close()
    assert compared == []
