"""AsyncVirtualLM: next-token log-probabilities over the whole vocabulary from a vLLM engine.

The data path of one batch (in the AsyncLM worker thread)::

    contexts -> one request each (max_tokens=1, request id in extra_args)
        -> LLMEngine.step() until all finish (vLLM schedules, chunks, caches prefixes)
        -> the capture processor files log_softmax rows by request id (vllm_capture)
        -> collective_rpc: take the rows -> [B, V] float32 -> trimmed to the vocabulary

vLLM's own ``logprobs=-1`` path would build one Python object per vocabulary
entry per request; the capture path moves one tensor per batch.
"""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Mapping

import torch

from genlm_backend.errors import CaptureError
from genlm_backend.llm.base import AsyncLM

VLLM_ENV_DEFAULTS: Mapping[str, str] = {
    # Keep the engine core in this process: captured rows then never cross a process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # CPU builds only: GiB of KV cache (vLLM's own default sizes it from free memory).
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
"""Environment defaults :meth:`AsyncVirtualLM.from_name` sets when they are unset."""

DEFAULT_ENGINE_OPTS: Mapping[str, object] = {"enable_prefix_caching": True}


def build_capture_engine(engine_args):
    """A ``vllm.v1.engine.llm_engine.LLMEngine`` whose sampler captures log-probabilities.

    Args:
        engine_args: A ``vllm.EngineArgs``.

    Raises:
        ValueError: options the capture path cannot serve (see
            :func:`~genlm_backend.llm.vllm_capture.install_capture`).
    """
    from vllm.v1.engine.llm_engine import LLMEngine

    from genlm_backend.llm.vllm_capture import install_capture

    vllm_config = engine_args.create_engine_config()
    install_capture(vllm_config)
    return LLMEngine.from_vllm_config(vllm_config, disable_log_stats=True)


class AsyncVirtualLM(AsyncLM):
    """Next-token log-probabilities from a vLLM engine, auto-batched, prefix-cached by vLLM.

    Each batch of distinct contexts becomes one vLLM request per context
    (``max_tokens=1``, greedy); vLLM schedules them (splitting long prompts
    and large batches over several steps) and reuses cached prefixes. Rows
    are the raw ``log_softmax`` of the model's logits in float32, before any
    temperature, trimmed to ``len(byte_vocab)`` (and renormalized if the model
    has extra columns), on :attr:`device` (the engine's device by default).

    Args:
        llm_engine: An engine from :func:`build_capture_engine` (or a
            ``vllm.LLM`` wrapping one).
        tokenizer: The model's Hugging Face tokenizer; the engine's when omitted.
        batch_size: Most distinct contexts per engine batch.
        timeout: Most seconds a request waits for its batch to fill.
        **kwargs: Further :class:`~genlm_backend.llm.base.AsyncLM` options.

    Raises:
        ValueError: the engine was not built for capture.
    """

    def __init__(self, llm_engine, tokenizer=None, batch_size: int = 64, timeout: float = 0.02,
                 **kwargs):
        self.llm_engine = getattr(llm_engine, "llm_engine", llm_engine)  # unwrap vllm.LLM
        try:
            self._rpc("genlm_discard_logprobs")
        except Exception as exc:
            raise ValueError(
                "llm_engine was not built for log-probability capture; build it with "
                "AsyncVirtualLM.from_name(...) or build_capture_engine(EngineArgs(...))"
            ) from exc
        vllm_config = self.llm_engine.vllm_config
        kwargs.setdefault("max_context_length", vllm_config.model_config.max_model_len - 1)
        kwargs.setdefault("device", vllm_config.device_config.device)
        super().__init__(
            tokenizer if tokenizer is not None else self.llm_engine.get_tokenizer(),
            batch_size=batch_size,
            timeout_s=timeout,
            **kwargs,
        )
        self._request_numbers = itertools.count()

    @classmethod
    def from_name(cls, model_name=None, engine_opts: dict | None = None, **kwargs) -> AsyncVirtualLM:
        """Start a capture engine for a local folder, a ``.gguf`` file or an id vLLM resolves offline.

        Sets :data:`VLLM_ENV_DEFAULTS` in ``os.environ`` where unset, before vLLM reads them.

        Args:
            model_name: ``None`` for the default model (SmolLM2-135M-Instruct).
            engine_opts: ``vllm.EngineArgs`` options, over :data:`DEFAULT_ENGINE_OPTS`
                (``model`` is set from ``model_name``).
            **kwargs: Constructor options.
        """
        for name, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from transformers import AutoTokenizer
        from vllm import EngineArgs

        from genlm_backend.models import resolve_model_path

        path = str(resolve_model_path(model_name))
        opts = {**DEFAULT_ENGINE_OPTS, **(engine_opts or {}), "model": path}
        engine = build_capture_engine(EngineArgs(**opts))
        tokenizer = AutoTokenizer.from_pretrained(opts.get("tokenizer") or path)
        return cls(engine, tokenizer, **kwargs)

    # ------------------------------------------------------------------ AsyncLM hooks

    def _compute_logprobs(self, contexts: list[tuple[int, ...]]) -> torch.Tensor:
        from vllm.inputs.engine import tokens_input

        request_ids = [f"genlm-{next(self._request_numbers)}" for _ in contexts]
        try:
            for request_id, context in zip(request_ids, contexts):
                self.llm_engine.add_request(
                    request_id, tokens_input(list(context)), _sampling_params(request_id)
                )
            self._run_until_finished(request_ids)
            logprobs = self._take_logprobs(request_ids)  # [B, V_model] float32
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            self._rpc("genlm_discard_logprobs", request_ids)
            raise
        return self._fit_to_vocab(logprobs).to(self.device)

    def _run_until_finished(self, request_ids: list[str]) -> None:
        pending = set(request_ids)
        while pending:
            if not self.llm_engine.has_unfinished_requests():
                raise CaptureError(f"the engine stopped with {len(pending)} requests unfinished")
            for output in self.llm_engine.step():
                if output.finished:
                    pending.discard(output.request_id)

    def _take_logprobs(self, request_ids: list[str]) -> torch.Tensor:
        replies = [r for r in self._rpc("genlm_take_logprobs", request_ids) if r is not None]
        if not replies:
            raise CaptureError("no worker returned the captured log-probabilities")
        return replies[0]

    def _fit_to_vocab(self, logprobs: torch.Tensor) -> torch.Tensor:
        """``[B, V_model]`` -> ``[B, len(byte_vocab)]``: extra columns dropped, missing ones -inf."""
        num_columns = logprobs.shape[1]
        if num_columns > self.vocab_size:
            return torch.log_softmax(logprobs[:, : self.vocab_size], dim=-1)
        if num_columns < self.vocab_size:
            return torch.nn.functional.pad(
                logprobs, (0, self.vocab_size - num_columns), value=float("-inf")
            )
        return logprobs

    def _rpc(self, method: str, *args):
        return self.llm_engine.collective_rpc(method, args=args)

    def _clear_model_caches(self) -> None:
        if getattr(self, "llm_engine", None) is not None:
            self.llm_engine.reset_prefix_cache()

    def _release_model(self) -> None:
        """Shut the engine down and free its memory, so another engine can start here."""
        engine, self.llm_engine = self.llm_engine, None
        if engine is None:
            return
        try:
            engine.collective_rpc("genlm_release_store")
        finally:
            engine.engine_core.shutdown()
            del engine
            gc.collect()
            _cleanup_vllm_process_state()


def _sampling_params(request_id: str):
    from vllm import SamplingParams

    from genlm_backend.llm.vllm_capture import REQUEST_ID_ARG

    return SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, extra_args={REQUEST_ID_ARG: request_id}
    )


def _cleanup_vllm_process_state() -> None:
    """Tear down vLLM's process-wide distributed state once no capture engine is left."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from genlm_backend.llm.vllm_capture import num_live_stores

    if num_live_stores() == 0:
        cleanup_dist_env_and_memory()
