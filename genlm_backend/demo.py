"""Character-constrained importance sampling: the library's main job, end to end.

N particles each write ``num_chars`` characters after a prompt, using only
characters from an allowed set (by default lowercase letters and space).
Each particle walks the token-character trie one byte at a time:

* after each complete token it awaits the model's next-token log-probabilities
  and the trie's per-node log-masses (``weight_logsumexp``), both auto-batched
  across particles;
* at trie node ``n`` it may take an allowed byte (child ``c``, log-mass
  ``m[c]``) or end the current token there (a leaf below ``n``);
* it picks one option in proportion to its mass and multiplies its weight by
  ``Z / m[n]``, the share of the model's mass that the constraint keeps.

The weights make the particles an importance sample of the model's
distribution over character strings, restricted to the allowed set.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from genlm_backend.llm.base import AsyncLM
from genlm_backend.trie import AsyncTokenCharacterTrie

DEFAULT_PROMPT = "Here is a short poem about the sea, in plain lowercase words:\n"
DEFAULT_ALLOWED = "abcdefghijklmnopqrstuvwxyz "


@dataclass(frozen=True)
class Particle:
    """One finished particle."""

    text: str
    """The characters it wrote."""
    log_weight: float
    """Log importance weight (``-inf`` if it ran out of allowed options)."""
    token_ids: list[int]
    """The complete tokens it chose (a last, unfinished token is not included)."""


@dataclass(frozen=True)
class SamplingResult:
    particles: list[Particle]

    @property
    def normalized_weights(self) -> np.ndarray:
        log_weights = np.array([p.log_weight for p in self.particles])
        if np.all(np.isneginf(log_weights)):
            return np.zeros_like(log_weights)
        return np.exp(log_weights - np.logaddexp.reduce(log_weights))

    @property
    def effective_sample_size(self) -> float:
        weights = self.normalized_weights
        total = float(np.sum(weights**2))
        return 1.0 / total if total > 0 else 0.0


async def importance_sample(
    llm: AsyncLM,
    trie: AsyncTokenCharacterTrie,
    prompt_ids: list[int],
    *,
    num_particles: int,
    num_chars: int,
    allowed: str = DEFAULT_ALLOWED,
    seed: int = 0,
    progress: bool = True,
) -> SamplingResult:
    """Run ``num_particles`` constrained particles concurrently; see the module docstring.

    Raises:
        ValueError: no particles, no characters, or an empty allowed set.
    """
    if num_particles < 1 or num_chars < 1:
        raise ValueError("num_particles and num_chars must be >= 1")
    allowed_bytes = frozenset(allowed.encode())
    if not allowed_bytes:
        raise ValueError("the allowed character set is empty")
    bar = tqdm(total=num_particles * num_chars, desc="characters", disable=not progress, leave=False)
    walker = _Walker(llm, trie, allowed_bytes, bar)
    try:
        particles = await asyncio.gather(
            *(walker.run(list(prompt_ids), num_chars, np.random.default_rng([seed, i])) for i in range(num_particles))
        )
    finally:
        bar.close()
    return SamplingResult(list(particles))


class _Walker:
    def __init__(self, llm: AsyncLM, trie: AsyncTokenCharacterTrie, allowed: frozenset[int], bar):
        self.llm, self.trie, self.allowed, self.bar = llm, trie, allowed, bar
        self.children = trie.trie.children
        self.root = trie.trie.root

    async def run(self, context: list[int], num_chars: int, rng: np.random.Generator) -> Particle:
        text, log_weight, node, log_mass = bytearray(), 0.0, self.root, None
        num_prompt = len(context)
        while len(text) < num_chars:
            if log_mass is None:
                logprobs = await self.llm.next_token_logprobs(context)
                log_mass = np.asarray(torch.as_tensor(await self.trie.weight_logsumexp(logprobs.cpu())).cpu())
            options = self._options(node, log_mass)
            if not options:
                return Particle(text.decode(errors="replace"), float("-inf"), context[num_prompt:])
            keys, log_masses = zip(*options)
            log_z = np.logaddexp.reduce(log_masses)
            log_weight += float(log_z - log_mass[node])
            choice = keys[rng.choice(len(keys), p=np.exp(np.array(log_masses) - log_z))]
            if isinstance(choice, tuple):  # end the token here
                context.append(choice[1])
                node, log_mass = self.root, None
            else:
                text.append(choice)
                node = self.children[node][choice]
                self.bar.update(1)
        return Particle(text.decode(errors="replace"), log_weight, context[num_prompt:])

    def _options(self, node: int, log_mass: np.ndarray) -> list[tuple]:
        options = []
        for key, child in self.children[node].items():
            if isinstance(key, tuple):
                if node != self.root:
                    options.append((key, log_mass[child]))
            elif key in self.allowed:
                options.append((key, log_mass[child]))
        return [(key, mass) for key, mass in options if mass > -np.inf]
