"""What a transformers pass's rows are made of: the attention its layers compute, as one typed
value (:class:`PassAttention`), and the strategy that chooses it (:class:`RowStrategy`).

Two strategies exist, chosen once per runner: the plain one
(:class:`~genlm_backend.llm.hf.runner.PlainRows`) and exact rows
(``deterministic=True``: :class:`~genlm_backend.llm.hf.exact.ExactRows`,
imported only when asked for). An executor hands the model's attention
layers the pass's value through :func:`~genlm_backend.llm.hf.compat.attending`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch

from genlm_backend.cache.plan import LevelPolicy, PassPlan
from genlm_backend.llm.hf.attention import Level


class PassAttention(Protocol):
    """The attention every layer of one pass computes."""

    optional: bool
    """A faster way to the model's own attention, which replaces it where the model's
    attention takes other arguments (then a value that is not optional is refused)."""

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """``[B, L, Hq, D]`` in ``query``'s dtype from ``query [B, Hq, L, D]`` and the own part's
        ``key``, ``value [B, Hkv, S, D]`` with its additive ``mask [B, 1, L, S]``."""


class RowStrategy(Protocol):
    """What a runner's rows are: every decision of a mode of computing them, made in one place."""

    def level_policy(self, enabled: bool) -> LevelPolicy:
        """How passes read cached pieces (``enabled``: whether the model's attention can read
        levels at all)."""

    def attention(
        self, plan: PassPlan, levels: list[Level], num_groups: int, num_slots: int
    ) -> PassAttention | None:
        """The attention of an eager pass over ``plan`` (``num_slots`` slots in its block)."""

    def step_attention(
        self,
        levels: list[Level],
        offsets: Sequence[int],
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        num_groups: int,
        num_slots: int,
    ) -> PassAttention | None:
        """The attention of a captured one-token step, made on the device from its inputs:
        ``(splits, firsts, writes)`` per row (tokens read as levels, first and written slot)."""

    def products(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Active around every forward pass of ``model`` (eager or captured): how its matrix
        products compute."""

    def attach(self, model: torch.nn.Module) -> None:
        """The model changed (an adapter loaded): whatever the strategy hooks on it, again."""
