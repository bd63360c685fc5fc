"""AsyncVirtualLM: next-token log-probabilities over the whole vocabulary from a vLLM engine.

The data path of one batch (in the AsyncLM worker thread)::

    contexts -> one request each (max_tokens=1, capture id in extra_args)
        -> LLMEngine.step() until all finish (vLLM schedules, chunks, caches prefixes)
        -> the capture processor files log_softmax rows by request id (vllm_capture)
        -> collective_rpc: take the rows -> [B, V] float32 -> trimmed to the vocabulary

vLLM's own ``logprobs=-1`` path would build one Python object per vocabulary
entry per request; the capture path moves one tensor per batch.

Particle sessions. A finished request leaves only whole KV blocks in vLLM's
prefix cache, so a context one token longer than a finished one would
recompute everything past its last full block (up to ``block_size`` tokens).
When the engine core runs in this process, each request is therefore
*resumable* (a vLLM streaming-input session): it keeps its keys/values,
partial block included, and a later context that extends it by one token is
sent to it as that one token. Sessions are kept by the context they last
computed, least recently used first out, at most ``max_sessions``.
"""

from __future__ import annotations

import gc
import itertools
import os
from collections import OrderedDict
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
        batch_size: Most distinct contexts per engine batch; ``None`` (default):
            every waiting context within the ``max_batch_tokens`` budget.
        timeout: Most seconds a request waits for company (``timeout_s`` of
            :class:`~genlm_backend.batching.BatchingConfig`).
        max_sessions: Most particle sessions kept open (each holds its keys/values
            in vLLM's KV cache); ``None``: twice ``batch_size``, or as many as the
            scheduler has request slots when ``batch_size`` is ``None``; 0 turns sessions off.
        **kwargs: Further :class:`~genlm_backend.llm.base.AsyncLM` options.

    Raises:
        ValueError: the engine was not built for capture.
    """

    def __init__(self, llm_engine, tokenizer=None, batch_size: int | None = None, timeout: float = 0.02,
                 *, max_sessions: int | None = None, **kwargs):
        if max_sessions is not None and not (isinstance(max_sessions, int) and max_sessions >= 0):
            raise ValueError(f"max_sessions must be an int >= 0, got {max_sessions!r}")
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
        self._scheduler = _in_process_scheduler(self.llm_engine)
        self.max_sessions = _default_max_sessions(batch_size, self._scheduler) if max_sessions is None else max_sessions
        self._sessions: OrderedDict[tuple[int, ...], str] = OrderedDict()  # context -> request id
        self._num_tokens_submitted = 0

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
        if self._scheduler is not None and self.max_sessions > 0:
            return self._compute_in_sessions(contexts)
        self._close_sessions(self._least_recent_sessions(len(self._sessions)))  # max_sessions set to 0
        from vllm.inputs.engine import tokens_input

        request_ids = [f"genlm-{next(self._request_numbers)}" for _ in contexts]
        try:
            for request_id, context in zip(request_ids, contexts):
                self.llm_engine.add_request(
                    request_id, tokens_input(list(context)), _sampling_params(request_id)
                )
                self._num_tokens_submitted += len(context)
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

    # ------------------------------------------------------------------ particle sessions

    def _compute_in_sessions(self, contexts: list[tuple[int, ...]]) -> torch.Tensor:
        """One row per context: a one-token step of an open session, a new session, or a plain request."""
        # An idle session holds one of vLLM's active-request slots; one slot stays
        # free so that requests beyond the sessions can always run.
        num_slots = max(0, min(self.max_sessions, self._scheduler.max_num_active_reqs - 1))
        stale = [self._sessions.pop(c) for c in contexts if c in self._sessions]  # recomputed anew
        plan = []  # (request id, context, tokens to send, keep as session)
        for context in contexts:
            session = self._sessions.pop(context[:-1], None)
            plan.append((session, context, context[-1:], True) if session else (None, context, context, False))
        num_open = sum(keep for *_, keep in plan)
        for i, (session, context, tokens, _) in enumerate(plan):
            if session is None:
                keep = num_open < num_slots
                num_open += keep
                prefix = "genlm-session" if keep else "genlm"
                plan[i] = (f"{prefix}-{next(self._request_numbers)}", context, tokens, keep)
        capture_ids = [f"genlm-capture-{next(self._request_numbers)}" for _ in contexts]
        request_ids = [request_id for request_id, *_ in plan]
        try:
            self._close_sessions(stale + self._least_recent_sessions(len(self._sessions) + num_open - num_slots))
            for (request_id, _, tokens, keep), capture_id in zip(plan, capture_ids):
                self._submit(request_id, tokens, capture_id, resumable=keep)
            self._run_until_done(request_ids)
            logprobs = self._take_logprobs(capture_ids)
        except BaseException:
            self._close_sessions(request_ids)
            self._rpc("genlm_discard_logprobs", capture_ids)
            raise
        for request_id, context, _, keep in plan:
            if keep:
                self._sessions[context] = request_id
        return self._fit_to_vocab(logprobs).to(self.device)

    def _submit(self, request_id: str, tokens: tuple[int, ...], capture_id: str, resumable: bool) -> None:
        """Send ``tokens`` as a new request, or as the next input of the open session ``request_id``."""
        from vllm.inputs.engine import tokens_input

        engine = self.llm_engine
        request = engine.input_processor.process_inputs(
            request_id, tokens_input(list(tokens)), _sampling_params(capture_id),
            supported_tasks=engine.get_supported_tasks(), resumable=resumable,
        )
        # These requests bypass the output processor (rows come from the capture
        # store), so the engine core gets each with its id as given.
        request.external_req_id = request.request_id
        engine.engine_core.add_request(request)
        self._num_tokens_submitted += len(tokens)

    def _run_until_done(self, request_ids: list[str]) -> None:
        """Step the engine until each request finished, or finished its turn (an open session).

        A prompt prefilled in several chunks has a row captured after every
        chunk; only the turn's end says the last one is in.
        """
        from vllm.v1.request import RequestStatus

        scheduler = self._scheduler

        def busy(request_id: str) -> bool:
            request = scheduler.requests.get(request_id)
            return request is not None and request.status != RequestStatus.WAITING_FOR_STREAMING_REQ

        pending = [request_id for request_id in request_ids if busy(request_id)]
        num_idle_steps = 0  # steps in a row that finished nothing and left nothing running
        while pending:
            if scheduler.get_num_unfinished_requests() == 0:  # idle sessions not counted
                raise CaptureError(f"the engine has nothing left to run with {len(pending)} requests unfinished")
            self.llm_engine.step()
            still_pending = [request_id for request_id in pending if busy(request_id)]
            progressed = len(still_pending) < len(pending) or scheduler.running
            pending = still_pending
            num_idle_steps = 0 if progressed else num_idle_steps + 1
            if pending and num_idle_steps >= 2:
                # Nothing could be scheduled twice in a row: idle sessions hold the
                # KV cache the waiting requests need. Close them (none is in this batch).
                idle = self._least_recent_sessions(len(self._sessions))
                if not idle:
                    raise CaptureError(f"vLLM cannot schedule {len(pending)} requests of this batch")
                self._close_sessions(idle)
                num_idle_steps = 0

    def _least_recent_sessions(self, count: int) -> list[str]:
        oldest = list(itertools.islice(self._sessions, max(count, 0)))
        return [self._sessions.pop(context) for context in oldest]

    def _close_sessions(self, request_ids: list[str]) -> None:
        """Finish these requests (open sessions or not) and free their keys/values."""
        if request_ids:
            self.llm_engine.engine_core.abort_requests(request_ids)

    @property
    def num_sessions(self) -> int:
        """Particle sessions open now."""
        return len(self._sessions)

    def _num_tokens_computed(self) -> int:
        # Tokens sent to vLLM: whole contexts for new requests, one token per session step.
        # vLLM's prefix cache may run fewer of the former.
        return self._num_tokens_submitted

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
            self._close_sessions(self._least_recent_sessions(len(self._sessions)))
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


def _in_process_scheduler(engine):
    """The scheduler particle sessions use, or ``None`` where they are not supported.

    Supported: the engine core in this process, one worker, the V1 model runner
    (the one sessions were tested with).
    """
    core = getattr(engine.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    config = engine.vllm_config
    if scheduler is None or config.parallel_config.world_size != 1 or config.use_v2_model_runner:
        return None
    return scheduler


def _cleanup_vllm_process_state() -> None:
    """Tear down vLLM's process-wide distributed state once no capture engine is left."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from genlm_backend.llm.vllm_capture import num_live_stores

    if num_live_stores() == 0:
        cleanup_dist_env_and_memory()


def _default_max_sessions(batch_size: int | None, scheduler) -> int:
    """Twice an explicit ``batch_size``; otherwise every request slot of the scheduler."""
    if batch_size is not None:
        return 2 * batch_size
    return 0 if scheduler is None else scheduler.max_num_active_reqs
