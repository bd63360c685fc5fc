"""AsyncVirtualLM: an :class:`~genlm_backend.llm.base.AsyncLM` over a vLLM capture engine.

The engine work (one request per context, captured log-probability rows,
particle sessions, adapters) is :class:`~genlm_backend.llm.vllm.runner.VLLMRunner`'s;
this module builds the engine and configures the runner.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from genlm_backend.llm.base import AsyncLM
from genlm_backend.llm.vllm import compat as vllm_compat
from genlm_backend.llm.vllm.compat import build_capture_engine
from genlm_backend.llm.vllm.runner import VLLMRunner

VLLM_ENV_DEFAULTS: Mapping[str, str] = {
    # Keep the engine core in this process: captured rows then never cross a process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # CPU builds only: GiB of KV cache (vLLM's own default sizes it from free memory).
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
"""Environment defaults :meth:`AsyncVirtualLM.from_name` sets when they are unset."""

DEFAULT_ENGINE_OPTS: Mapping[str, object] = {"enable_prefix_caching": True}


class AsyncVirtualLM(AsyncLM):
    """Next-token log-probabilities from a vLLM engine, auto-batched, prefix-cached by vLLM.

    Each batch of distinct contexts becomes one vLLM request per context
    (``max_tokens=1``, greedy); vLLM schedules them (splitting long prompts
    and large batches over several steps) and reuses cached prefixes. Rows
    are the raw ``log_softmax`` of the model's logits in float32, before any
    temperature, trimmed to ``len(byte_vocab)`` (and renormalized if the model
    has extra columns), on :attr:`device` (the engine's device by default).
    LoRA adapters need an engine built with ``enable_lora=True``; each request
    carries its own ``LoRARequest``.

    Args:
        llm_engine: An engine from :func:`build_capture_engine` (or a
            ``vllm.LLM`` wrapping one).
        tokenizer: The model's Hugging Face tokenizer; the engine's when omitted.
        batch_size: Most distinct contexts per engine batch; ``None`` (default):
            every waiting context within the ``max_batch_tokens`` budget.
        timeout: Most seconds a request waits for company (``timeout_s`` of
            :class:`~genlm_backend.batching.BatchingConfig`).
        max_sessions: Most particle sessions kept open (each holds its keys/values
            in vLLM's KV cache); ``None``: twice ``batch_size``, or as many as the
            scheduler has request slots when ``batch_size`` is ``None``, and 0 where
            sessions are not supported (see
            :func:`~genlm_backend.llm.vllm.compat.sessions_unsupported`);
            0 turns sessions off.
        **kwargs: Further :class:`~genlm_backend.llm.base.AsyncLM` options.

    Raises:
        ValueError: the engine was not built for capture, a bad ``max_sessions``,
            or ``max_sessions > 0`` on an engine that cannot run sessions.
        ImportError: the installed vLLM is not a supported version.
    """

    runner: VLLMRunner

    def __init__(
        self,
        llm_engine,
        tokenizer=None,
        batch_size: int | None = None,
        timeout: float = 0.02,
        *,
        max_sessions: int | None = None,
        **kwargs,
    ):
        if max_sessions is not None and not (isinstance(max_sessions, int) and max_sessions >= 0):
            raise ValueError(f"max_sessions must be an int >= 0, got {max_sessions!r}")
        vllm_compat.check_vllm_version()
        self.llm_engine = getattr(llm_engine, "llm_engine", llm_engine)  # unwrap vllm.LLM
        try:
            self.llm_engine.collective_rpc("genlm_discard_logprobs")
        except Exception as exc:
            raise ValueError(
                "llm_engine was not built for log-probability capture; build it with "
                "AsyncVirtualLM.from_name(...) or build_capture_engine(EngineArgs(...))"
            ) from exc
        self.sessions_unsupported = vllm_compat.sessions_unsupported(self.llm_engine)
        """Why particle sessions are off on this engine (``None``: they are available)."""
        _check_sessions(max_sessions, self.sessions_unsupported)
        vllm_config = self.llm_engine.vllm_config
        kwargs.setdefault("max_context_length", vllm_config.model_config.max_model_len - 1)
        kwargs.setdefault("device", vllm_config.device_config.device)
        super().__init__(
            tokenizer if tokenizer is not None else self.llm_engine.get_tokenizer(),
            batch_size=batch_size,
            timeout_s=timeout,
            **kwargs,
        )
        sessions = (
            _default_max_sessions(batch_size, self.sessions_unsupported, self.llm_engine)
            if max_sessions is None
            else max_sessions
        )
        self.runner = VLLMRunner(self.llm_engine, self.vocab_size, self.device, sessions)
        # vLLM runs its own threads and kernels: its steps run in a worker thread,
        # and the event loop stays free while the engine works.
        self.engine.compute_in_loop = False

    @classmethod
    def from_name(
        cls, model_name=None, engine_opts: dict | None = None, **kwargs
    ) -> AsyncVirtualLM:
        """Start a capture engine for a local folder, a ``.gguf`` file or an id vLLM resolves offline.

        Sets :data:`VLLM_ENV_DEFAULTS` in ``os.environ`` where unset, before vLLM reads them.

        Args:
            model_name: ``None`` for the default model (SmolLM2-135M-Instruct).
            engine_opts: ``vllm.EngineArgs`` options, over :data:`DEFAULT_ENGINE_OPTS`
                (``model`` is set from ``model_name``; ``enable_lora=True`` for adapters).
            **kwargs: Constructor options, and ``deterministic=True``: vLLM's
                batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``), which vLLM
                provides on NVIDIA GPUs of compute capability 8.0 or higher.

        Raises:
            ValueError: ``deterministic=True`` where vLLM has no batch-invariant kernels.
        """
        if kwargs.pop("deterministic", False):
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
            check_batch_invariance_available()
        for name, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        vllm_compat.check_vllm_version()
        from transformers import AutoTokenizer
        from vllm import EngineArgs

        from genlm_backend.models import resolve_model_path

        path = str(resolve_model_path(model_name))
        opts = {**DEFAULT_ENGINE_OPTS, **(engine_opts or {}), "model": path}
        engine = build_capture_engine(EngineArgs(**opts))
        tokenizer = AutoTokenizer.from_pretrained(opts.get("tokenizer") or path)
        return cls(engine, tokenizer, **kwargs)

    @property
    def max_sessions(self) -> int:
        """Most particle sessions kept open (settable; 0 turns sessions off)."""
        return self.runner.max_sessions

    @max_sessions.setter
    def max_sessions(self, value: int) -> None:
        _check_sessions(value, self.sessions_unsupported)
        self.runner.max_sessions = value

    @property
    def num_sessions(self) -> int:
        """Particle sessions open now."""
        return self.runner.num_sessions

    @property
    def underlying_model(self):
        """The torch model the engine runs (engine core in this process only)."""
        return vllm_compat.underlying_model(self.llm_engine)

    def close(self) -> None:
        super().close()
        self.llm_engine = None


def _default_max_sessions(batch_size: int | None, unsupported: str | None, engine) -> int:
    """0 where sessions are unsupported; else twice an explicit ``batch_size``, or every request slot."""
    if unsupported is not None:
        return 0
    if batch_size is not None:
        return 2 * batch_size
    return vllm_compat.in_process_scheduler(engine).max_num_active_reqs


def _check_sessions(max_sessions: int | None, unsupported: str | None) -> None:
    """Refuse particle sessions asked for on an engine that cannot run them, saying why.

    Raises:
        ValueError: ``max_sessions`` > 0 where sessions are unsupported.
    """
    if max_sessions and unsupported is not None:
        raise ValueError(
            f"max_sessions={max_sessions}, but particle sessions cannot run here: {unsupported}; "
            "pass max_sessions=0 (or leave it unset): every context then runs as a plain "
            "request, with the same rows"
        )


def check_batch_invariance_available() -> None:
    """Raise unless vLLM's batch-invariant mode can run here (an NVIDIA GPU of compute capability 8.0+).

    Raises:
        ValueError: it cannot; the message says where rows are reproducible instead.
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        return
    raise ValueError(
        "deterministic=True on the vLLM backend needs vLLM's batch-invariant kernels, which "
        "run on NVIDIA GPUs of compute capability 8.0 or higher; none is here. The "
        "transformers backend (backend='hf') gives reproducible rows on CPUs."
    )
