"""Character-constrained importance sampling: the library's main job, end to end.

N particles each write ``num_chars`` characters after a prompt, using only
characters from an allowed set (by default lowercase letters and space).

Target: the model's distribution over token sequences whose tokens are made
only of allowed characters, truncated at ``num_chars`` characters. Proposal:
each particle builds its next token byte by byte on the token-character trie:

* after each complete token it awaits the model's next-token log-probabilities,
  masks the tokens that use a disallowed character, and awaits the trie's
  per-node log-masses of what is left (``weight_logsumexp``); both awaits are
  auto-batched across particles;
* from trie node ``n`` it takes an allowed byte (child ``c``) or ends the token
  at ``n`` (a leaf), in proportion to the allowed mass below each option, so
  it never walks into a prefix that no allowed token completes;
* its log weight grows by the log of the allowed mass at the root: the share
  of the model's next-token mass the constraint keeps.

A token is thereby drawn from the model's distribution restricted to allowed
tokens, one character at a time, and the weights correct for the restriction.
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
        self.llm, self.trie, self.bar = llm, trie, bar
        self.children = trie.trie.children
        self.root = trie.trie.root
        self.allowed_tokens = torch.tensor(
            [len(token) > 0 and set(token) <= allowed for token in llm.byte_vocab], device=llm.device
        )

    async def run(self, context: list[int], num_chars: int, rng: np.random.Generator) -> Particle:
        text, log_weight, node, log_mass = bytearray(), 0.0, self.root, None
        num_prompt = len(context)
        while len(text) < num_chars:
            if log_mass is None:
                log_mass = await self._allowed_log_mass(context)
                log_weight += float(log_mass[self.root])  # the share of mass the constraint keeps
                if log_mass[self.root] == -np.inf:
                    break
            keys, log_masses = self._options(node, log_mass)
            probs = np.exp(log_masses - log_mass[node])
            choice = keys[rng.choice(len(keys), p=probs / probs.sum())]
            if isinstance(choice, tuple):  # end the token here: (None, token_id)
                context.append(choice[1])
                node, log_mass = self.root, None
            else:
                text.append(choice)
                node = self.children[node][choice]
                self.bar.update(1)
        return Particle(text.decode(errors="replace"), log_weight, context[num_prompt:])

    async def _allowed_log_mass(self, context: list[int]) -> np.ndarray:
        """Per trie node: log of the next-token mass of the allowed tokens below it."""
        logprobs = await self.llm.next_token_logprobs(context)
        masked = logprobs.masked_fill(~self.allowed_tokens, float("-inf"))
        return np.asarray(torch.as_tensor(await self.trie.weight_logsumexp(masked)).cpu(), dtype=np.float64)

    def _options(self, node: int, log_mass: np.ndarray) -> tuple[list, np.ndarray]:
        """Children of ``node`` (bytes, and token ends below the root) with allowed mass."""
        keys, masses = [], []
        for key, child in self.children[node].items():
            if log_mass[child] > -np.inf and (node != self.root or not isinstance(key, tuple)):
                keys.append(key)
                masses.append(log_mass[child])
        return keys, np.array(masses)
