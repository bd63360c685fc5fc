"""Character-constrained importance sampling: the library's main job, end to end.

N particles each write ``num_chars`` characters after a prompt, using only
characters from an allowed set (by default lowercase letters and space).
Characters are Unicode characters, not bytes: with ``allowed="é "`` a particle
may use a token for ``é``, or one token ending in its first UTF-8 byte and a
next one starting with its second.

Target: the model's distribution over token sequences whose tokens are made
only of allowed characters, truncated at ``num_chars`` characters. Proposal:
each particle builds its next token byte by byte on the token-character trie:

* after each complete token it awaits the model's next-token log-probabilities,
  masks the tokens that cannot continue its text with allowed characters
  (given the bytes of a character it has begun), and awaits the trie's
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

    Each particle writes ``num_chars`` characters (Unicode characters) from
    ``allowed``, unless it runs out of allowed tokens first (weight ``-inf``).

    Raises:
        ValueError: no particles, no characters, or an empty allowed set.
    """
    if num_particles < 1 or num_chars < 1:
        raise ValueError("num_particles and num_chars must be >= 1")
    constraint = CharacterConstraint(allowed, llm.byte_vocab, llm.device)
    bar = tqdm(
        total=num_particles * num_chars,
        desc="characters written (all particles)",
        unit="char",
        disable=not progress,
        leave=False,
    )
    walker = _Walker(llm, trie, constraint, bar)
    try:
        particles = await asyncio.gather(
            *(
                walker.run(list(prompt_ids), num_chars, np.random.default_rng([seed, i]))
                for i in range(num_particles)
            )
        )
    finally:
        bar.close()
    return SamplingResult(list(particles))


class CharacterConstraint:
    """Which tokens may come next when the text may use only ``allowed`` characters.

    A text is a byte string; it is acceptable when it splits into the UTF-8
    encodings of allowed characters, possibly followed by the first bytes
    (``pending``) of one. UTF-8 is prefix-free, so that split is unique.
    """

    def __init__(self, allowed: str, byte_vocab, device: torch.device | str = "cpu"):
        """
        Raises:
            ValueError: ``allowed`` is empty.
        """
        if not allowed:
            raise ValueError("the allowed character set is empty")
        self.encodings = frozenset(char.encode() for char in allowed)
        self.partials = frozenset(code[:end] for code in self.encodings for end in range(len(code)))
        self.byte_vocab, self.device = byte_vocab, device
        self._masks: dict[bytes, torch.Tensor] = {}

    def step(self, pending: bytes, data: bytes) -> tuple[bytes, int] | None:
        """``(pending bytes, characters completed)`` after appending ``data``; ``None`` if not allowed."""
        num_completed = 0
        for byte in data:
            pending += bytes((byte,))
            if pending in self.encodings:
                pending, num_completed = b"", num_completed + 1
            elif pending not in self.partials:
                return None
        return pending, num_completed

    def token_mask(self, pending: bytes) -> torch.Tensor:
        """Bool ``[len(byte_vocab)]`` on ``device``: the non-empty tokens that may follow ``pending``."""
        if pending not in self._masks:
            keep = [
                len(token) > 0 and self.step(pending, token) is not None
                for token in self.byte_vocab
            ]
            self._masks[pending] = torch.tensor(keep, device=self.device)
        return self._masks[pending]


class _Walker:
    def __init__(
        self, llm: AsyncLM, trie: AsyncTokenCharacterTrie, constraint: CharacterConstraint, bar
    ):
        self.llm, self.trie, self.constraint, self.bar = llm, trie, constraint, bar
        self.children = trie.trie.children
        self.root = trie.trie.root

    async def run(self, context: list[int], num_chars: int, rng: np.random.Generator) -> Particle:
        text, pending, num_written = bytearray(), b"", 0
        log_weight, node, log_mass = 0.0, self.root, None
        num_prompt = len(context)
        while num_written < num_chars:
            if log_mass is None:
                log_mass = await self._allowed_log_mass(context, pending)
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
                # Only bytes below allowed tokens have mass, so the step is always allowed.
                stepped = self.constraint.step(pending, bytes((choice,)))
                assert stepped is not None
                pending, num_completed = stepped
                num_written += num_completed
                self.bar.update(num_completed)
        return Particle(text.decode(errors="replace"), log_weight, context[num_prompt:])

    async def _allowed_log_mass(self, context: list[int], pending: bytes) -> np.ndarray:
        """Per trie node: log of the next-token mass of the tokens allowed after ``pending`` below it."""
        logprobs = await self.llm.next_token_logprobs(context)
        masked = logprobs.masked_fill(~self.constraint.token_mask(pending), float("-inf"))
        return np.asarray(
            torch.as_tensor(await self.trie.weight_logsumexp(masked)).cpu(), dtype=np.float64
        )

    def _options(self, node: int, log_mass: np.ndarray) -> tuple[list, np.ndarray]:
        """Children of ``node`` (bytes, and token ends below the root) with allowed mass."""
        keys, masses = [], []
        for key, child in self.children[node].items():
            if log_mass[child] > -np.inf and (node != self.root or not isinstance(key, tuple)):
                keys.append(key)
                masses.append(log_mass[child])
        return keys, np.array(masses)
