"""Every use of transformers' and peft's internals by the HF runner, in one place, checked at construction.

The runner relies on transformers details beyond its documented API: a
``StaticLayer`` subclass that holds tensors the runner allocated (the
attributes ``StaticLayer`` sets, and ``update``'s signature), a
``StaticCache`` built from such layers, the attention-function registry,
``config._attn_implementation``, and the config attribute names that give a
decoder's shape and length. They are
known to work with the versions in :data:`SUPPORTED_TRANSFORMERS`;
:func:`check_transformers_version` raises a clear error elsewhere.

LoRA adapters go through peft (:class:`PeftAdapters`): the model is wrapped
in a ``peft.PeftModel`` when the first adapter loads, each registration
under a name of its own inside peft.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from genlm_backend.llm.hf.rows import PassAttention
from genlm_backend.llm.runner import Adapter

SUPPORTED_TRANSFORMERS = (5, 6)
"""Major versions of transformers whose internals this module was written against: ``[5, 6)``."""


def check_transformers_version(version: str | None = None) -> None:
    """Raise ``ImportError`` unless transformers' major version is in :data:`SUPPORTED_TRANSFORMERS`.

    Args:
        version: The version to check; the installed one when omitted.
    """
    if version is None:
        import transformers

        version = transformers.__version__
    major = int(version.split(".")[0])
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= major < high:
        raise ImportError(
            f"AsyncTransformer needs transformers >={low},<{high} (it uses StaticCache and attention "
            f"internals of those versions); found {version}. Install a supported version: "
            f"pip install 'transformers>={low},<{high}'"
        )


@contextmanager
def head_sees_only(model, reads: tuple[torch.Tensor, torch.Tensor] | None):
    """While active, the output head gets the hidden states at ``reads = (rows, positions)`` only.

    Rows yield logits at different new positions (each row's last, and the
    positions of contexts nested in it), so the model is asked for logits at
    every new position; without this the head would compute ``[B, K, V]``
    logits (``B * K * V`` floats, gigabytes for long prompts) to keep a few.
    The head's input becomes ``[N, 1, H]``, one per read, and the model's
    logits ``[N, 1, V]``. The hook sits on the head module, so whatever the
    model does after it (soft-capping, scaling) still applies.
    ``reads=None`` leaves the head alone.
    """
    head = model.get_output_embeddings() if reads is not None else None
    if reads is None or head is None:
        yield
        return
    rows, positions = reads

    def gather(module, args):
        hidden = args[0]  # [B, K, H] -> [N, 1, H]
        return (hidden[rows, positions][:, None], *args[1:])

    handle = head.register_forward_pre_hook(gather, prepend=True)  # before any padding
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def head_vocabulary_major(model):
    """While active, a plain float32 ``nn.Linear`` output head without bias on the CPU computes
    its logits as ``weight @ hidden.T`` (the vocabulary as the product's long side), a block
    of :data:`HEAD_BLOCK_ROWS` entries at a time, copied into rows: ``F.linear``'s logits
    within rounding (for a few rows MKL sums their products in another order; the same bits
    at one row and at 16 and 64 rows here).

    Alone, MKL's product with the rows as the short side (``F.linear``) takes 1.04x
    to 1.46x as long at 16 and 64 rows (about 3x at 4 rows), and as long at one
    row, for a 49,152-token vocabulary of width 256 or 576, on two threads; on
    one, 0.95x to 1.09x. With the log-softmax written into the logits
    (:func:`~genlm_backend.llm.runner.fit_to_vocab`), a runner's step of 64 rows
    is 9 to 18% shorter (``benchmarks/bench_head.py``; BENCHMARKS.md, "The CPU head in
    blocks"). Any other head is left alone.
    """
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if (
        type(head) is not torch.nn.Linear
        or head.bias is not None
        or not isinstance(weight, torch.Tensor)
        or weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or "forward" in vars(head)  # already replaced (a pass within a pass)
    ):
        yield
        return
    # In the module's own dict, where nn.Module.__setattr__ would put it; popped, not deleted:
    # two runners sharing one model may overlap their passes (the same product either way).
    vars(head)["forward"] = functools.partial(_vocabulary_major_product, weight)
    try:
        yield
    finally:
        vars(head).pop("forward", None)


HEAD_BLOCK_ROWS = 2048
"""Vocabulary entries per product of the CPU head (:func:`head_vocabulary_major`): each block's
``[2048, B]`` logits are copied into the rows while they are in the cache, and the block's
weights (2 to 16 MB for widths of 256 to 2,048) are read once. Of 512 to 8,192 entries, none
was the fastest at every width (256 to 2,048), row count (4 to 64) and thread count (1,
2): 1,024 to 4,096 were within the runs' noise of one another (one size timed twice in a
run differed by up to 13%), 512 and 8,192 up to 31% slower at some shapes
(``benchmarks/bench_head.py --blocks``; BENCHMARKS.md, "The CPU head in blocks")."""


def _vocabulary_major_product(
    weight: torch.Tensor, hidden: torch.Tensor, block_rows: int = HEAD_BLOCK_ROWS
) -> torch.Tensor:
    """``F.linear(hidden, weight)``, computed as ``weight @ rows.T`` a block of the vocabulary at
    a time, each block copied into the rows: ``[..., V]``, contiguous."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    vocab, num_rows = weight.shape[0], rows.shape[0]
    if torch.is_grad_enabled() and (weight.requires_grad or rows.requires_grad):
        return torch.nn.functional.linear(hidden, weight)  # out= products record no gradient
    if num_rows == 1 or vocab <= block_rows:
        logits = torch.mm(weight, rows.T).T.contiguous()
    else:
        logits = rows.new_empty(num_rows, vocab)
        block = rows.new_empty(block_rows, num_rows)
        columns = rows.T
        for start in range(0, vocab, block_rows):
            end = min(vocab, start + block_rows)
            part = block[: end - start]
            torch.mm(weight[start:end], columns, out=part)
            logits[:, start:end].copy_(part.T)
    return logits.view(*hidden.shape[:-1], vocab)


_GROUPED_SDPA = "genlm_sdpa_grouped_kv"


def _sdpa_grouped_kv(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' ``sdpa`` attention, except that masked grouped-query attention on CPU keeps its heads grouped.

    With any mask, transformers repeats each key/value head once per query
    head it serves before calling SDPA (CUDA's fused kernels take no mask with
    grouped heads). That repeat copies every key and value of the batch in every
    layer (``benchmarks/bench_attention.py`` measures its share of a step). On CPU, ``scaled_dot_product_attention(..., enable_gqa=True)``
    takes a mask and gives the same result without the copy. Every other case
    is handed to transformers' function unchanged.
    """
    plain = (
        attention_mask is None
        or query.device.type != "cpu"
        or query.shape[1] == key.shape[1]
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("output_attentions")
    )
    if plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


_CURRENT: contextvars.ContextVar[PassAttention | None] = contextvars.ContextVar(
    "genlm_pass_attention", default=None
)


def current_attention() -> PassAttention | None:
    """The attention of the pass running in this context (``None``: the model's own)."""
    return _CURRENT.get()


@contextmanager
def attending(attention: PassAttention | None) -> Iterator[None]:
    """While active, the model's attention layers compute ``attention`` (``None``: their own)."""
    token = _CURRENT.set(attention)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _genlm_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    **kwargs,
):
    """The runner's attention function: the pass's
    :class:`~genlm_backend.llm.hf.rows.PassAttention` (:func:`current_attention`),
    else :func:`_sdpa_grouped_kv`.

    A model whose attention takes arguments a pass's attention cannot serve
    (sinks, soft-capping, dropout) gets its own function where the pass's is
    optional, and a clear error where it is not.
    """
    attention = current_attention()
    other = sorted(k for k in _UNSUPPORTED_BY_LEVELS if kwargs.get(k) is not None)
    if attention is None or ((other or dropout) and attention.optional):
        return _sdpa_grouped_kv(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    if other or dropout:
        raise NotImplementedError(
            f"{type(attention).__name__} cannot serve this model's attention arguments "
            f"{other or ['dropout']}"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attention.attend(module.layer_idx, query, key, value, attention_mask, scale), None


# ``sliding_window`` is not among them: contexts never exceed the window (see attention_window).
_UNSUPPORTED_BY_LEVELS = ("s_aux", "sinks", "position_bias", "softcap", "cache")


@contextmanager
def grouped_kv_attention(config):
    """While active, a model using transformers' ``sdpa`` attention uses the runner's function (:func:`_genlm_attention`).

    ``config``: the model's decoder config (``model.config.get_text_config(decoder=True)``,
    14 us a call: a runner reads it once per model). The attention implementation
    is written where a config without sub-configs keeps it: transformers' setter
    passes through the config's validating ``__setattr__`` and its sub-configs,
    which cost 45 us a pass for the two changes; the whole switch now costs about 10.
    """
    if config._attn_implementation != "sdpa":
        yield
        return
    _register_grouped_sdpa()
    attributes = vars(config)
    if "_attn_implementation_internal" in attributes and not config.sub_configs:
        attributes["_attn_implementation_internal"] = _GROUPED_SDPA
        try:
            yield
        finally:
            attributes["_attn_implementation_internal"] = "sdpa"
        return
    config._attn_implementation = _GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


@functools.cache
def _register_grouped_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_GROUPED_SDPA, _genlm_attention)
    AttentionMaskInterface.register(_GROUPED_SDPA, sdpa_mask)


def shared_levels_unsupported(model) -> str | None:
    """Why the runner cannot read shared prefixes once for this model (``None``: it can).

    The merge by log-sum-exp is exact for plain softmax attention over every
    earlier token (sliding windows included: contexts stay within the window,
    see :func:`attention_window`). Soft-capped scores, attention sinks and
    attention functions other than ``sdpa`` are left to the copying path.
    """
    config = model.config.get_text_config(decoder=True)
    if config._attn_implementation != "sdpa":
        return f"attention implementation {config._attn_implementation!r} (needs 'sdpa')"
    for name in ("attn_logit_softcapping", "final_attn_softcapping"):
        if getattr(config, name, None):
            return f"soft-capped attention scores ({name})"
    if getattr(config, "sinks", None) is not None or config.model_type == "gpt_oss":
        return "attention sinks"
    return None


def attention_window(config) -> int | None:
    """The narrowest attention window of any layer (sliding or chunked), ``None`` if every layer sees all.

    Within its window a sliding-window layer attends like a full one, so
    the runner serves contexts up to this length with full-attention caches.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    _, per_layer = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    windows = [kwargs["sliding_window"] for kwargs in per_layer if kwargs.get("sliding_window")]
    return min(windows) if windows else None


class StaticCaches:
    """Makes ``StaticCache``\\ s over the runner's tensors for one model, sliding-window layers as full ones (see :func:`attention_window`).

    The model's layer kinds are checked once: ``StaticCache``'s own
    constructor reads them from the config on every call, host time the
    runner would pay once per forward pass.

    Raises:
        NotImplementedError: a layer keeps something other than softmax
            attention's keys and values (linear-attention or indexer state),
            or keys and values differ in head dimension.
    """

    def __init__(self, config):
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

        template = StaticCache(config=config, max_cache_len=1)
        kinds = {type(layer) for layer in template.layers}
        if not kinds <= {StaticLayer, StaticSlidingWindowLayer}:
            names = sorted(
                kind.__name__ for kind in kinds - {StaticLayer, StaticSlidingWindowLayer}
            )
            raise NotImplementedError(
                f"AsyncTransformer serves models whose every layer is softmax attention over "
                f"cached keys and values; this model's cache has layers of kind {', '.join(names)}"
            )
        self.num_layers = len(template.layers)
        self._layer = _runner_layer_class()
        widths = _key_value_widths(config)
        if len(set(widths.values())) > 1:
            raise NotImplementedError(
                "AsyncTransformer serves models whose keys and values have one head dimension; "
                f"this model's config gives {widths} (multi-head latent attention?)"
            )

    def __call__(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], num_filled: int):
        """A ``StaticCache`` whose layers hold ``layers``' keys and values (``[B, H, T, D]`` each), ``num_filled`` slots written.

        The forward pass writes its new keys/values from slot ``num_filled`` on.
        """
        from transformers import StaticCache
        from transformers.cache_utils import Cache

        cache = StaticCache.__new__(StaticCache)
        Cache.__init__(
            cache, layers=[self._layer(keys, values, num_filled) for keys, values in layers]
        )
        return cache

    def scattered(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor):
        """A ``StaticCache`` over ``layers`` (``[B, H, T, D]`` each) where row ``i``'s one new token goes to slot ``slots[i]``.

        ``slots`` is a ``[B]`` int64 tensor on the layers' device: the write
        positions are device data, read by the device (a captured step).
        """
        from transformers import StaticCache
        from transformers.cache_utils import Cache

        layer = _scattered_layer_class()
        cache = StaticCache.__new__(StaticCache)
        Cache.__init__(cache, layers=[layer(keys, values, slots) for keys, values in layers])
        return cache


@functools.cache
def _scattered_layer_class():
    class ScatteredLayer(_runner_layer_class()):  # type: ignore[misc]
        """A ``StaticLayer`` over the runner's tensors writing each row's one new token at its slot, given as a device tensor."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
            super().__init__(keys, values, 0)
            # [B] -> [B, H, 1, D], the index scatter_ takes along the slots
            self._index = slots[:, None, None, None].expand(*keys.shape[:2], 1, keys.shape[-1])

        def update(self, key_states, value_states, *args, **kwargs):
            # key_states: [B, H, 1, D]
            keys, values = self._tensors
            keys.scatter_(2, self._index, key_states)
            values.scatter_(2, self._index, value_states)
            return keys, values

        def get_seq_length(self) -> int:
            return 0  # positions and the mask are given: nothing reads it

    return ScatteredLayer


@functools.cache
def _runner_layer_class():
    from transformers.cache_utils import StaticLayer

    class RunnerLayer(StaticLayer):
        """A ``StaticLayer`` over the runner's tensors, writing each update at a slot kept as a Python int.

        ``StaticLayer.update`` finds its slots from a 0-d position tensor: an
        ``arange``, two additions and two indexed copies per layer and pass,
        and a tensor allocated per layer at construction. Here an update is
        two slice copies at a slot kept as an int (the runner knows the slot
        every new token goes to): fewer device operations, no allocation.
        """

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, num_filled: int):
            # What StaticLayer's __init__ and lazy_initialization set, without their
            # allocations: the position tensor is never read here, the runner owns the tensors.
            self.max_cache_len = keys.shape[2]
            self.dtype, self.device = keys.dtype, keys.device
            self.batch_size, self.num_heads = keys.shape[:2]
            self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
            self.keys, self.values = keys, values
            self.is_initialized = True
            self._tensors = (keys, values)
            self._next_slot = num_filled

        def update(self, key_states, value_states, *args, **kwargs):
            (keys, values), start = self._tensors, self._next_slot
            num_new = key_states.shape[-2]
            keys.narrow(2, start, num_new).copy_(key_states)
            values.narrow(2, start, num_new).copy_(value_states)
            self._next_slot = start + num_new
            return keys, values

        def get_seq_length(self) -> int:
            return self._next_slot

    return RunnerLayer


def _key_value_widths(config) -> dict[str, int]:
    """The head dimensions a decoder's config names for keys and values, by attribute."""
    text = config.get_text_config(decoder=True)
    widths = {"head_dim": kv_shape(config)[1]}
    if getattr(text, "qk_nope_head_dim", None) is not None:  # DeepSeek's latent attention
        widths["qk_nope_head_dim + qk_rope_head_dim"] = text.qk_nope_head_dim + getattr(
            text, "qk_rope_head_dim", 0
        )
    for name in ("qk_head_dim", "v_head_dim"):
        if getattr(text, name, None) is not None:
            widths[name] = getattr(text, name)
    return widths


def kv_shape(config) -> tuple[int, int]:
    """``(key/value heads, head dimension)`` of a decoder, from its config's attribute names."""
    text = config.get_text_config(decoder=True)
    num_heads = getattr(text, "num_attention_heads", None) or text.n_head
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return num_kv_heads, head_dim


def max_positions(config) -> int:
    """Longest sequence the model's positions cover (``1 << 30`` when the config names none)."""
    text = config.get_text_config(decoder=True)
    return (
        getattr(text, "max_position_embeddings", None)
        or getattr(text, "n_positions", None)
        or 1 << 30
    )


def cache_nbytes(num_layers, batch, heads, slots, head_dim, dtype) -> int:
    """Bytes of a cache's keys and values: ``[batch, heads, slots, head_dim]`` twice per layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * batch * heads * slots * head_dim * element


# ---------------------------------------------------------------------- peft adapters


class PeftAdapters:
    """The peft adapters loaded into one model, by name.

    The model is wrapped in a ``peft.PeftModel`` when the first adapter is
    loaded and unwrapped when the last one is unloaded (:attr:`model`
    follows). Inside peft, each registration has its own name
    (:func:`peft_name`), so weights are never mixed up across registrations
    of one name. Each registration is remembered as its
    :class:`~genlm_backend.llm.runner.Adapter`, so a request made under weights
    that were since replaced or removed fails instead of running under others.
    """

    def __init__(self, model):
        self.model = model
        self._loaded: dict[str, Adapter] = {}

    def load(self, adapter: Adapter) -> None:
        """Load ``adapter``'s weights under its name, replacing an adapter of that name.

        Raises:
            ImportError: peft is not installed.
        """
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise ImportError("LoRA adapters need peft: pip install peft") from exc
        old = self._loaded.get(adapter.name)
        if isinstance(self.model, PeftModel):
            self.model.load_adapter(adapter.path, adapter_name=peft_name(adapter))
        else:
            self.model = PeftModel.from_pretrained(
                self.model, adapter.path, adapter_name=peft_name(adapter)
            )
        self.model.eval()
        self._loaded[adapter.name] = adapter
        if old is not None:
            self.model.delete_adapter(peft_name(old))

    def unload(self, adapter: Adapter) -> None:
        """Delete ``adapter``'s weights if they are the ones loaded under its name."""
        if self._loaded.get(adapter.name) == adapter:
            self._delete(adapter.name)

    def _delete(self, name: str) -> None:
        adapter = self._loaded.pop(name)
        if not self._loaded:
            self.model = self.model.unload()  # the base model, LoRA layers removed
            return
        if self.model.active_adapter == peft_name(adapter):
            # peft keeps one adapter active: switch to another before deleting this one.
            self.model.set_adapter(peft_name(next(iter(self._loaded.values()))))
        self.model.delete_adapter(peft_name(adapter))

    @contextmanager
    def active(self, adapter: Adapter | None) -> Iterator[None]:
        """Run the model under ``adapter`` (``None``: the base model) within this block.

        Raises:
            ValueError: ``adapter`` is no longer the registration loaded under its name.
        """
        if adapter is None:
            if self._loaded:
                with self.model.disable_adapter():
                    yield
            else:
                yield
            return
        if self._loaded.get(adapter.name) != adapter:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} was removed or re-registered while this request waited"
            )
        self.model.set_adapter(peft_name(adapter))
        yield


def peft_name(adapter: Adapter) -> str:
    """The name a registration has inside peft: unique per registration."""
    return f"genlm_adapter_{adapter.version}"
