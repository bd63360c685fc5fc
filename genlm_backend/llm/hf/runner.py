"""Batched next-token forward passes of a transformers model, reusing cached prefixes.

No asyncio here: :meth:`HFRunner.run` takes distinct requests and returns a
``[B, V]`` tensor. The prefix-cache driver
(:class:`~genlm_backend.llm.runner.PrefixCacheDriver`) looks each context
up in the KV tree, plans the batch and commits its keys/values; the
:class:`TransformersExecutor` runs each planned pass; the runner's
:class:`~genlm_backend.llm.hf.rows.RowStrategy`, chosen here once, says how
the passes compute their rows: :class:`PlainRows`, or exact rows with
``deterministic=True`` (:mod:`~genlm_backend.llm.hf.exact`, imported only then).

A pass's rows read shared levels in place (a long prompt in front of every
particle, read once for all of them: :mod:`~genlm_backend.llm.hf.attention`)
and their own part from the pass's block: each row's own past copied into a
new block, or a step writing in place into the block it extends. A
transformers ``StaticCache`` over the block's tensors lets the model write
the new keys/values there; a 4-D mask lets each row see exactly its own
part; position ids continue each row's own positions. One-token passes
replay as captured steps where the device captures
(:mod:`~genlm_backend.llm.hf.graphs`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from genlm_backend.cache import plan as planner
from genlm_backend.cache.kv_block import KVBlock, int_tensor
from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.cache.plan import LevelPolicy, PassPlan
from genlm_backend.llm.hf.attention import Cascade, Level, cascade_attention
from genlm_backend.llm.hf.compat import (
    PeftAdapters,
    StaticCaches,
    attending,
    cache_nbytes,
    check_transformers_version,
    grouped_kv_attention,
    head_sees_only,
    head_vocabulary_major,
    kv_shape,
    max_positions,
    shared_levels_unsupported,
)
from genlm_backend.llm.hf.graphs import StepGraphs
from genlm_backend.llm.hf.rows import PassAttention, RowStrategy
from genlm_backend.llm.runner import (
    Adapter,
    ExecutorSupport,
    PassResult,
    PrefixCacheDriver,
    PrefixCacheRunner,
    Request,
    fit_to_vocab,
)


class HFRunner(PrefixCacheRunner):
    """Turns batches of requests into next-token log-probabilities with KV-prefix reuse.

    Requests are grouped by adapter; each group runs with its adapter active
    and its keys/values live under that adapter in the tree.

    Args:
        model: A transformers causal LM in eval mode (full-attention layers).
        kv_tree: Where keys/values are looked up and left.
        vocab_size: Columns of the output (the tokenizer's vocabulary): extra
            logit columns are dropped, missing ones are ``-inf``.
        deterministic: Every row has the bits of its context computed alone
            from an empty cache, whatever shares its pass and whatever the tree
            holds (:class:`~genlm_backend.llm.hf.exact.ExactRows`).
        executor: What runs a planned pass: ``"transformers"`` (the model's own
            forward), ``"fused"`` (the Llama family's fused decoder,
            :class:`FusedExecutor`) or ``"auto"`` (fused where the family is
            supported and BENCHMARKS.md shows it faster on the model's kind of
            device: :data:`FUSED_BY_DEFAULT`; else transformers).

    Raises:
        ImportError: the installed transformers is not a supported version.
        ValueError: ``deterministic`` for a model whose attention the runner cannot
            compute itself, or on a device and dtype where rows are not exact;
            ``executor="fused"`` for a model outside the Llama family (the message
            names it) or with ``deterministic``; an unknown ``executor``.
    """

    adapters: PeftAdapters

    def __init__(
        self,
        model,
        kv_tree: KVPrefixTree,
        vocab_size: int,
        deterministic: bool = False,
        executor: str = "auto",
    ):
        check_transformers_version()
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        adapters = PeftAdapters(model)
        self.levels_unsupported = shared_levels_unsupported(model)
        """Why shared prefixes are copied per row for this model (``None``: they are read once)."""
        self.strategy = _strategy(model, self.levels_unsupported, deterministic)
        self.deterministic = deterministic
        plain = TransformersExecutor(
            lambda: adapters.model,
            kv_tree,
            vocab_size,
            max_positions(model.config),
            self.strategy,
            self.levels_unsupported,
        )
        self.executor_of_transformers = plain
        """The executor running the transformers model (also :attr:`executor` by default)."""
        self.executor: TransformersExecutor | FusedExecutor = _executor(
            executor, model, plain, deterministic
        )
        super().__init__(
            PrefixCacheDriver(kv_tree, self.executor, vocab_size), adapters, model.device
        )

    @property
    def model(self):
        """The model (a peft model once an adapter was loaded)."""
        return self.adapters.model

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def graphs(self) -> StepGraphs:
        """One-token steps captured as graphs (on CUDA), the rest eager: see :mod:`~genlm_backend.llm.hf.graphs`."""
        return self.executor.graphs

    @torch.inference_mode()
    def logprobs(self, contexts, namespace=None, parents=None) -> torch.Tensor:
        """``float32 [len(contexts), vocab_size]``: the rows after ``contexts``, the model as it is."""
        return self.driver.logprobs(contexts, namespace, parents)

    @torch.inference_mode()
    def score_continuations(self, pairs, namespace=None) -> list[torch.Tensor]:
        """The driver's scores of ``(context, continuation)`` pairs, the model as it is."""
        return self.driver.score(pairs, namespace)

    def score(self, requests):
        with torch.inference_mode():
            return super().score(requests)

    @torch.inference_mode()
    def run_uncached(self, request: Request) -> torch.Tensor:
        """Reference: one plain forward pass over the whole context under its adapter, no cache involved."""
        input_ids = torch.tensor([list(request.context)], device=self.device)
        with self.adapters.active(request.adapter):
            logits = self.model(input_ids=input_ids, use_cache=False).logits[:, -1]
        return fit_to_vocab(logits, self.vocab_size)[0]

    def load_adapter(self, adapter: Adapter) -> None:
        self.graphs.clear()  # captured under the model as it was
        super().load_adapter(adapter)
        self.strategy.attach(self.model)  # the adapter's projections

    def unload_adapter(self, adapter: Adapter) -> None:
        self.graphs.clear()
        super().unload_adapter(adapter)

    def clear(self) -> None:
        self.graphs.clear()
        super().clear()


EXECUTORS = ("auto", "fused", "transformers")

FUSED_BY_DEFAULT: frozenset[str] = frozenset()
"""Device kinds where ``executor="auto"`` picks the fused decoder: where BENCHMARKS.md shows it
faster, compile included. None yet: on the CPU an SMC run of 16x32 is 7% faster compiled ahead
but 1.54x slower with its compile (about 20 s cold) inside; no GPU has measured it."""


def _executor(
    choice: str, model, plain: TransformersExecutor, deterministic: bool
) -> TransformersExecutor | FusedExecutor:
    """The runner's executor (see :class:`HFRunner`'s ``executor``)."""
    if choice == "transformers" or (
        choice == "auto" and (deterministic or model.device.type not in FUSED_BY_DEFAULT)
    ):
        return plain
    from genlm_backend.llm.hf.fused import SUPPORTED_ARCHITECTURES, FusedDecoder

    if choice == "auto" and type(model).__name__ not in SUPPORTED_ARCHITECTURES:
        return plain
    if deterministic:
        raise ValueError(
            "executor='fused' does not compute exact rows yet: deterministic=True runs the "
            "transformers executor (executor='transformers' or 'auto')"
        )
    return FusedExecutor(FusedDecoder.of(model), plain)


def _strategy(model, levels_unsupported: str | None, deterministic: bool) -> RowStrategy:
    """The one place deterministic mode is chosen: its package is imported only here, only then."""
    if not deterministic:
        return PlainRows()
    from genlm_backend.llm.hf.exact import ExactRows

    return ExactRows(model, levels_unsupported)


# ---------------------------------------------------------------------- the executor


class TransformersExecutor:
    """Runs planned passes of a transformers model (see the module).

    Args:
        model_of: The model to run (the runner's: it changes when adapters load).
        kv_tree: Where the passes' blocks are reserved.
        vocab_size: Columns of the output.
        max_positions: The model's longest sequence.
        strategy: How the passes compute their rows.
        levels_unsupported: Why this model's shared prefixes are copied per row
            (``None``: they are read once, as levels).
    """

    support = ExecutorSupport(adapters=True, captured_steps=True, exact_rows=True)

    def __init__(
        self,
        model_of: Callable[[], Any],
        kv_tree: KVPrefixTree,
        vocab_size: int,
        max_positions: int,
        strategy: RowStrategy,
        levels_unsupported: str | None,
    ):
        self._model_of = model_of
        self.kv_tree = kv_tree
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.strategy = strategy
        config = model_of().config
        self.caches = StaticCaches(config)
        self.num_kv_heads, self.head_dim = kv_shape(config)
        self.num_groups = (
            config.get_text_config(decoder=True).num_attention_heads // self.num_kv_heads
        )
        self._placed: tuple[int, torch.device, torch.dtype, Any] | None = None
        self._step_mask = StepMask()
        self.level_policy: LevelPolicy = strategy.level_policy(levels_unsupported is None)
        """How passes read cached pieces (settable: tests and benchmarks try other policies)."""
        self.graphs = StepGraphs(
            model_of, self.caches, kv_tree, vocab_size, max_positions, strategy=strategy
        )
        """One-token steps captured as graphs (on CUDA), the rest eager."""
        if levels_unsupported is not None:
            self.graphs.unsupported = f"shared levels unsupported: {levels_unsupported}"

    @property
    def model(self):
        return self._model_of()

    def run_pass(self, plan: PassPlan, namespace: Hashable) -> PassResult:
        """The pass's rows (as a captured step where it can be), the block written, and where its
        rows' contexts are in it."""
        step = (
            self.graphs.plan(plan, namespace)
            if self.graphs.can_capture and plan.num_new == 1
            else None
        )
        ran = self.graphs.run(step) if step is not None else None
        if step is None or ran is None:
            logprobs, block = self.forward(plan)
            return PassResult(logprobs, block, plan.placements)
        return PassResult(*ran, step.placements)

    @torch.inference_mode()
    def forward(
        self, plan: PassPlan, model_logits: ModelLogits | None = None
    ) -> tuple[torch.Tensor, KVBlock]:
        """``[len(plan.reads), vocab_size]`` log-probabilities in the order of ``plan.reads``, and
        the block written; the logits from ``model_logits`` (``None``: :meth:`model_logits`,
        the transformers model's forward), a fresh tensor of the pass's own, which
        :func:`~genlm_backend.llm.runner.fit_to_vocab` normalizes in place."""
        device, dtype = self.placement()
        inputs = planner.pass_inputs(plan, self.max_positions)
        block = plan.extends if plan.extends is not None else self._block_with_pasts(plan, inputs)
        pass_ = ModelPass(
            input_ids=int_tensor(inputs.tokens, device),  # [B, num_new]
            position_ids=int_tensor(inputs.positions, device),
            cache=self.caches(block.layers, plan.num_past),
            mask=self._step_mask(plan, inputs, block, dtype, device),
            attention=self.strategy.attention(
                plan, cascade_levels(plan, inputs, device), self.num_groups, block.num_slots
            ),
            # A one-token step reads each row's only position; a longer pass, its reads' positions.
            reads=_read_positions(plan, device) if plan.num_new > 1 else None,
        )
        logits = (model_logits or self.model_logits)(pass_)  # [len(plan.reads), V_model]
        return fit_to_vocab(logits, self.vocab_size, own=True), block

    def placement(self) -> tuple[torch.device, torch.dtype]:
        """The model's device and dtype (transformers reads them off its parameters at each
        call: kept per model object)."""
        placed = self._placed_model()
        return placed[1], placed[2]

    def decoder_config(self) -> Any:
        """The model's decoder config (``get_text_config(decoder=True)``: kept per model object)."""
        return self._placed_model()[3]

    def _placed_model(self) -> tuple[int, torch.device, torch.dtype, Any]:
        model = self.model
        placed = self._placed
        if placed is None or placed[0] != id(model):
            config = model.config.get_text_config(decoder=True)
            placed = self._placed = (id(model), model.device, model.dtype, config)
        return placed

    def model_logits(self, pass_: ModelPass) -> torch.Tensor:
        """The transformers model's logits of a pass's reads, ``[R, V_model]``."""
        model, reads = self.model, pass_.reads
        with (
            grouped_kv_attention(self.decoder_config()),
            attending(pass_.attention),
            head_sees_only(model, reads),
            self.strategy.products(model),
        ):
            output = model(
                input_ids=pass_.input_ids,
                attention_mask=pass_.mask,
                position_ids=pass_.position_ids,
                past_key_values=pass_.cache,
                use_cache=True,
                logits_to_keep=pass_.input_ids.shape[1],
            )
        # logits: [N, 1, V_model] per read, [B, 1, V_model] for one-token steps,
        # or [B, num_new, V_model] for a head the hook cannot reach
        if output.logits.shape[1] == 1 or reads is None:
            return output.logits[:, 0]
        return output.logits[reads]

    def _block_with_pasts(self, plan: PassPlan, inputs: planner.PassInputs) -> KVBlock:
        """A block of ``num_past + num_new`` slots (and spare ones) with each row's own past right-aligned at ``num_past``."""
        num_past, num_new = plan.num_past, plan.num_new
        # One-token steps get spare slots, so the next steps can write in place (see plan.extendable_block).
        num_spare = planner.spare_slots(num_past) if num_new == 1 else 0
        # Slots are not positions (position ids are given): rows whose own pasts and new tokens
        # together pass the model's longest sequence still get every slot they need.
        num_slots = max(min(num_past + num_new + num_spare, self.max_positions), num_past + num_new)
        num_layers = self.caches.num_layers
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        device, dtype = self.placement()
        shape = (len(plan.rows), num_kv_heads, num_slots, head_dim)
        self.kv_tree.reserve(
            cache_nbytes(num_layers, len(plan.rows), num_kv_heads, num_slots, head_dim, dtype),
            pinned=[entry for row in plan.rows for entry, _ in row.levels + row.own],
        )
        block = KVBlock.empty(num_layers, shape, dtype, device)
        block.copy_in(inputs.copies)
        # Every slot is written above or by the forward pass itself; only the left
        # padding is zeroed (masked, but it must not hold NaN bit patterns), and the
        # spare slots (masked, but read by attention). One operation each for all layers.
        slots = block.stacked  # [L, 2, B, H, T, D]
        for i, row in enumerate(plan.rows):
            if row.num_own_past < num_past:
                slots[:, :, i, :, : num_past - row.num_own_past].zero_()
        if num_past + num_new < num_slots:
            slots[..., num_past + num_new :, :].zero_()
        return block


def _read_positions(plan: PassPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, positions)`` of ``plan.reads`` as index tensors on ``device``."""
    reads = plan.reads
    rows = int_tensor([row for _, row, _ in reads], device)
    positions = int_tensor([at for _, _, at in reads], device)
    return rows, positions


def own_part_mask(
    plan: PassPlan, inputs: planner.PassInputs, num_slots: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """Additive mask ``[B, 1, num_new, num_slots]``: each row sees its own past and its causal new tokens.

    Made in numpy (a few operations on small arrays cost a third of torch's), then one copy
    to ``dtype`` on ``device``.
    """
    slots = np.arange(num_slots)
    queries = np.arange(plan.num_new)[:, None] + plan.num_past  # slot of each query
    first = np.array(inputs.row_starts)[:, None, None]
    visible = (slots >= first) & (slots <= queries)  # [B, num_new, num_slots]
    wide = np.float64 if dtype == torch.float64 else np.float32  # holds finfo(dtype).min
    mask = np.where(visible[:, None], wide(0), wide(torch.finfo(dtype).min))
    return torch.from_numpy(mask).to(device=device, dtype=dtype)


class StepMask:
    """The mask of one-token steps writing in place: the last step's, one slot wider.

    A particles' step extends the same block row by row, each row's own part
    starting where it did: its mask is the last step's with the slot this
    step writes made visible, one small write instead of a new mask (whose
    numpy work costs about 0.15 ms a step for 64 rows). Any other pass gets
    :func:`own_part_mask`. The kept mask holds its block weakly (an evicted
    block's memory is not held), and is handed to one pass at a time: the
    model only reads it during its forward.
    """

    def __init__(self) -> None:
        self._kept: tuple[weakref.ref, int, list[int], torch.Tensor] | None = None

    def __call__(
        self,
        plan: PassPlan,
        inputs: planner.PassInputs,
        block: KVBlock,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """The additive mask of ``plan``'s pass over ``block`` (see :func:`own_part_mask`)."""
        kept, self._kept = self._kept, None
        if plan.num_new != 1:
            return own_part_mask(plan, inputs, block.num_slots, dtype, device)
        num_past, row_starts = plan.num_past, inputs.row_starts
        if (
            kept is not None
            and plan.extends is block
            and kept[0]() is block
            and kept[1] == num_past - 1
            and kept[3].dtype == dtype
            and kept[3].device == device
            and kept[2] == row_starts
        ):
            mask = kept[3]
            mask[..., num_past] = 0  # the slot this step writes: now visible to every row
        else:
            mask = own_part_mask(plan, inputs, block.num_slots, dtype, device)
        self._kept = (weakref.ref(block), num_past, row_starts, mask)
        return mask


def cascade_levels(plan: PassPlan, inputs: planner.PassInputs, device: torch.device) -> list[Level]:
    """The pass's distinct levels, each with the rows that read it (``None``: every row)."""
    return [
        Level(
            entry.block,
            entry.row,
            entry.start,
            n,
            None if len(rows) == len(plan.rows) else int_tensor(rows, device),
        )
        for (entry, n), rows in inputs.levels
    ]


@dataclass(frozen=True)
class ModelPass:
    """One pass's model inputs, made from its plan: what a model call needs."""

    input_ids: torch.Tensor
    """``[B, num_new]`` int64: each row's new tokens, padded after its own."""
    position_ids: torch.Tensor
    """``[B, num_new]`` int64."""
    cache: Any
    """A ``StaticCache`` over the pass's block: layer ``i``'s ``update(keys, values)`` writes
    the new keys/values and returns the layer's whole ``[B, Hkv, S, D]`` keys and values."""
    mask: torch.Tensor
    """Additive ``[B, 1, num_new, S]`` over the block's slots."""
    attention: PassAttention | None
    """The pass's attention (``None``: plain softmax over the own part with :attr:`mask`)."""
    reads: tuple[torch.Tensor, torch.Tensor] | None
    """``(rows, positions)`` of the new tokens whose logits are wanted; ``None``: each row's last."""


ModelLogits = Callable[[ModelPass], torch.Tensor]
"""How an executor gets a pass's logits, ``[R, V_model]``, from its :class:`ModelPass`: a fresh
tensor, which :meth:`TransformersExecutor.forward` normalizes in place (never a buffer that
a later pass writes again, such as a captured graph's output)."""


class FusedExecutor:
    """Planned passes run by the Llama family's fused decoder (:mod:`~genlm_backend.llm.hf.fused`).

    Its passes are the transformers executor's (``plain``: inputs, blocks,
    masks, levels, the row strategy's attention); only the model call differs:
    the decoder's compiled layers around the pass's attention, which writes the
    new keys/values into the pass's block. Passes under a LoRA adapter run the
    transformers model under peft (the decoder holds the base weights). Its steps
    run eagerly: no captured steps.
    """

    support = ExecutorSupport(adapters=True, captured_steps=False, exact_rows=False)

    def __init__(self, decoder: Any, plain: TransformersExecutor):
        self.decoder = decoder
        self.plain = plain
        plain.graphs.unsupported = "the fused executor runs its steps eagerly"

    @property
    def level_policy(self) -> LevelPolicy:
        return self.plain.level_policy

    @level_policy.setter
    def level_policy(self, policy: LevelPolicy) -> None:
        self.plain.level_policy = policy

    @property
    def graphs(self) -> StepGraphs:
        return self.plain.graphs

    def run_pass(self, plan: PassPlan, namespace: Hashable) -> PassResult:
        if namespace is not None:  # an adapter's pass: the transformers model under peft
            return self.plain.run_pass(plan, namespace)
        logprobs, block = self.plain.forward(plan, self.model_logits)
        return PassResult(logprobs, block, plan.placements)

    def model_logits(self, pass_: ModelPass) -> torch.Tensor:
        """The fused decoder's logits of the pass's reads, ``[R, V_model]``."""
        decoder, cache, attention, mask = self.decoder, pass_.cache, pass_.attention, pass_.mask

        def attend(layer: int, query, key, value) -> torch.Tensor:
            keys, values = cache.layers[layer].update(key, value)  # [B, Hkv, S, D] each
            if attention is not None:
                return attention.attend(layer, query, keys, values, mask, decoder.scale)
            output = torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=decoder.scale, enable_gqa=True
            )
            return output.transpose(1, 2)  # [B, L, Hq, D]

        return decoder(pass_.input_ids, pass_.position_ids, attend, pass_.reads)


# ---------------------------------------------------------------------- plain rows


class Causal:
    """Plain causal attention over every key: the mask is exactly causal (nothing cached, no
    padding), so the kernel skips the hidden half without reading it."""

    optional = True

    def attend(self, layer, query, key, value, mask, scale) -> torch.Tensor:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=True
        )
        return output.transpose(1, 2).contiguous()


class Levels:
    """The rows' own parts merged with the shared levels they read (:func:`cascade_attention`)."""

    optional = False

    def __init__(self, levels: list[Level]):
        self.cascade = Cascade(levels)

    def attend(self, layer, query, key, value, mask, scale) -> torch.Tensor:
        return cascade_attention(layer, query, key, value, mask, scale, self.cascade)


class PlainRows:
    """The default: each pass attends the fastest way its layout allows."""

    def level_policy(self, enabled: bool) -> LevelPolicy:
        return LevelPolicy(enabled=enabled)

    def attention(
        self, plan: PassPlan, levels: list[Level], num_groups: int, num_slots: int
    ) -> PassAttention | None:
        if levels:
            return Levels(levels)
        is_causal = (
            plan.num_past == 0
            and num_slots == plan.num_new
            and all(row.num_new == plan.num_new for row in plan.rows)
        )
        return Causal() if is_causal else None

    def step_attention(self, levels, offsets, inputs, num_groups, num_slots):
        return Levels(levels) if levels else None

    def products(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return head_vocabulary_major(model)

    def attach(self, model: torch.nn.Module) -> None:
        """Nothing hooked."""
