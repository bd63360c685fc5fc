"""Batches of requests through a vLLM capture engine: one engine request per context, particle sessions.

The data path of one batch (in the AsyncLM worker thread)::

    requests -> one engine request each (max_tokens=1, capture id in extra_args,
                the request's LoRARequest) -> LLMEngine.step() until all finish
        -> the capture processor files log_softmax rows by capture id (vllm/capture.py)
        -> collective_rpc: take the rows -> [B, V] float32 -> trimmed to the vocabulary

Particle sessions. A finished request leaves only whole KV blocks in vLLM's
prefix cache, so a context one token longer than a finished one would
recompute everything past its last full block. When the engine core runs in
this process, each request is therefore *resumable* (a vLLM streaming-input
session): it keeps its keys/values, partial block included, and a later
request that extends it by one token, under the same adapter, is sent to it
as that one token. Sessions are kept by request, least recently used first
out, at most ``max_sessions``.
"""

from __future__ import annotations

import gc
import itertools
from collections import OrderedDict
from collections.abc import Sequence

import torch

from genlm_backend.errors import CaptureError
from genlm_backend.llm.runner import (
    Adapter,
    Request,
    RunnerStats,
    ScoreRequest,
    fit_to_vocab,
    score_from_rows,
)
from genlm_backend.llm.vllm import compat as vllm_compat


class VLLMRunner:
    """Turns batches of requests into rows of a capture engine (see :func:`~genlm_backend.llm.vllm.compat.build_capture_engine`).

    Args:
        engine: A ``vllm.v1.engine.llm_engine.LLMEngine`` built for capture.
        vocab_size: Columns of the output.
        device: Where rows are returned.
        max_sessions: Most particle sessions kept open; 0 turns them off.
    """

    def __init__(self, engine, vocab_size: int, device: torch.device, max_sessions: int):
        self.engine = engine
        self.vocab_size = vocab_size
        self.device = device
        self.max_sessions = max_sessions
        self.num_tokens_submitted = 0
        self._request_numbers = itertools.count()
        self._scheduler = vllm_compat.in_process_scheduler(engine)
        self._model_vocab_size = engine.vllm_config.model_config.get_vocab_size()
        self._sessions: OrderedDict[Request, str] = OrderedDict()  # request -> engine request id
        self._loaded: dict[str, Adapter] = {}  # the registration each adapter name has now

    @property
    def stats(self) -> RunnerStats:
        # Tokens sent to vLLM: whole contexts for new requests, one token per session step.
        return RunnerStats(num_tokens_computed=self.num_tokens_submitted, kv_cache_bytes=0)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget: the tokens it sends to vLLM.

        One for a request that extends an open session by one token; its whole
        context otherwise (vLLM's prefix cache may still serve part of it).
        Without this, a step of particles behind a long prompt was counted at
        their whole contexts and split into several engine runs. Called from
        the event loop while a batch may run, so it is an estimate.
        """
        if (
            self._scheduler is not None
            and self.max_sessions > 0
            and len(request.context) > 1
            and _parent(request) in self._sessions
        ):
            return 1
        return len(request.context)

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        self._check_adapters(requests)
        if self._scheduler is not None and self.max_sessions > 0:
            return self._run_in_sessions(requests)
        self.close_sessions()  # max_sessions was set to 0
        return self._run_plain(requests)

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Each continuation scored by vLLM's own prompt log-probabilities: one value per token.

        Where the model's logits have more columns than the tokenizer's
        vocabulary, rows must be renormalized over the vocabulary, which
        prompt log-probabilities cannot give: there the scores are gathered
        from the prefixes' rows.
        """
        self._check_adapters(requests)
        if self._model_vocab_size != self.vocab_size:
            return score_from_rows(self.run, requests)
        request_ids = [f"genlm-score-{next(self._request_numbers)}" for _ in requests]
        fulls = [request.context + request.continuation for request in requests]
        try:
            for request_id, request, full in zip(request_ids, requests, fulls):
                vllm_compat.add_scoring_request(
                    self.engine, request_id, full, self._lora_request(request.adapter)
                )
                self.num_tokens_submitted += len(full)
            outputs = self._run_until_finished(request_ids)
        except BaseException:
            self.engine.abort_request(request_ids)
            raise
        return [
            torch.tensor(
                vllm_compat.prompt_token_logprobs(outputs[request_id], full, len(request.context)),
                dtype=torch.float32,
            )
            for request_id, request, full in zip(request_ids, requests, fulls)
        ]

    def run_uncached(self, request: Request) -> torch.Tensor:
        """One plain engine request (vLLM's prefix cache may still serve its prefix)."""
        self._check_adapters([request])
        return self._run_plain([request])[0]

    def _run_plain(self, requests: Sequence[Request]) -> torch.Tensor:
        request_ids = [f"genlm-{next(self._request_numbers)}" for _ in requests]
        try:
            for request_id, request in zip(request_ids, requests):
                vllm_compat.add_plain_request(
                    self.engine, request_id, request.context, self._lora_request(request.adapter)
                )
                self.num_tokens_submitted += len(request.context)
            self._run_until_finished(request_ids)
            logprobs = self._take_logprobs(request_ids)  # [B, V_model] float32
        except BaseException:
            self.engine.abort_request(request_ids)
            self._rpc("genlm_discard_logprobs", request_ids)
            raise
        return self._as_rows(logprobs)

    def _run_until_finished(self, request_ids: list[str]) -> dict:
        """Step the engine until every request finished; returns their final outputs by id."""
        pending = set(request_ids)
        finished = {}
        while pending:
            if not self.engine.has_unfinished_requests():
                raise CaptureError(f"the engine stopped with {len(pending)} requests unfinished")
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    pending.discard(output.request_id)
                    finished[output.request_id] = output
        return finished

    # ------------------------------------------------------------------ particle sessions

    def _plan_sessions(
        self, requests: Sequence[Request]
    ) -> tuple[list[tuple[str, Request, tuple[int, ...], bool]], int]:
        """Per request (engine request id, request, tokens to send, keep as session), and how many sessions to close."""
        # An idle session holds one of vLLM's active-request slots; one slot stays
        # free so that requests beyond the sessions can always run.
        num_slots = max(0, min(self.max_sessions, self._scheduler.max_num_active_reqs - 1))
        plan: list[tuple[str | None, Request, tuple[int, ...], bool]] = []
        for request in requests:
            session = self._sessions.pop(_parent(request), None)
            plan.append(
                (session, request, request.context[-1:], True)
                if session
                else (None, request, request.context, False)
            )
        num_open = sum(keep for *_, keep in plan)
        named = []
        for session, request, tokens, keep in plan:
            if session is None:
                keep = num_open < num_slots
                num_open += keep
                prefix = "genlm-session" if keep else "genlm"
                session = f"{prefix}-{next(self._request_numbers)}"
            named.append((session, request, tokens, keep))
        return named, len(self._sessions) + num_open - num_slots

    def _run_in_sessions(self, requests: Sequence[Request]) -> torch.Tensor:
        """One row per request: a one-token step of an open session, a new session, or a plain request."""
        stale = [self._sessions.pop(r) for r in requests if r in self._sessions]  # recomputed anew
        plan, num_to_close = self._plan_sessions(requests)
        capture_ids = [f"genlm-capture-{next(self._request_numbers)}" for _ in requests]
        request_ids = [request_id for request_id, *_ in plan]
        try:
            self._close_sessions(stale + self._least_recent_sessions(num_to_close))
            for (request_id, request, tokens, keep), capture_id in zip(plan, capture_ids):
                vllm_compat.add_session_request(
                    self.engine,
                    request_id,
                    tokens,
                    capture_id,
                    keep,
                    self._lora_request(request.adapter),
                )
                self.num_tokens_submitted += len(tokens)
            self._run_until_done(request_ids)
            logprobs = self._take_logprobs(capture_ids)
        except BaseException:
            self._close_sessions(request_ids)
            self._rpc("genlm_discard_logprobs", capture_ids)
            raise
        for request_id, request, _, keep in plan:
            if keep:
                self._sessions[request] = request_id
        return self._as_rows(logprobs)

    def _run_until_done(self, request_ids: list[str]) -> None:
        """Step the engine until each request finished, or finished its turn (an open session).

        A prompt prefilled in several chunks has a row captured after every
        chunk; only the turn's end says the last one is in.
        """
        scheduler = self._scheduler

        def busy(request_id: str) -> bool:
            return vllm_compat.is_busy(scheduler, request_id)

        pending = [request_id for request_id in request_ids if busy(request_id)]
        num_idle_steps = 0  # steps in a row that finished nothing and left nothing running
        while pending:
            if scheduler.get_num_unfinished_requests() == 0:  # idle sessions not counted
                raise CaptureError(
                    f"the engine has nothing left to run with {len(pending)} requests unfinished"
                )
            self.engine.step()
            still_pending = [request_id for request_id in pending if busy(request_id)]
            progressed = len(still_pending) < len(pending) or scheduler.running
            pending = still_pending
            num_idle_steps = 0 if progressed else num_idle_steps + 1
            if pending and num_idle_steps >= 2:
                # Nothing could be scheduled twice in a row: idle sessions hold the
                # KV cache the waiting requests need. Close them (none is in this batch).
                idle = self._least_recent_sessions(len(self._sessions))
                if not idle:
                    raise CaptureError(
                        f"vLLM cannot schedule {len(pending)} requests of this batch"
                    )
                self._close_sessions(idle)
                num_idle_steps = 0

    def close_sessions(self) -> None:
        """Close every particle session (vLLM's prefix cache keeps their whole blocks)."""
        self._close_sessions(self._least_recent_sessions(len(self._sessions)))

    def _least_recent_sessions(self, count: int) -> list[str]:
        oldest = list(itertools.islice(self._sessions, max(count, 0)))
        return [self._sessions.pop(request) for request in oldest]

    def _close_sessions(self, request_ids: list[str]) -> None:
        """Finish these engine requests (open sessions or not) and free their keys/values."""
        if request_ids:
            self.engine.engine_core.abort_requests(request_ids)

    # ------------------------------------------------------------------ adapters

    def _check_adapters(self, requests: Sequence[Request | ScoreRequest]) -> None:
        """Raises ``ValueError`` when a request's adapter is not loaded now, before any request
        reaches the engine (vLLM itself would load it again from its path)."""
        for request in requests:
            adapter = request.adapter
            if adapter is not None and self._loaded.get(adapter.name) != adapter:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r} was removed or re-registered while this request waited"
                )

    def _lora_request(self, adapter: Adapter | None):
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.version, adapter.path)

    def load_adapter(self, adapter: Adapter) -> None:
        """Register ``adapter`` with the engine (its int id is ``adapter.version``).

        Raises:
            ValueError: the engine was built without LoRA support.
        """
        if self.engine.vllm_config.lora_config is None:
            raise ValueError(
                "this vLLM engine was built without LoRA support; build it with "
                "AsyncVirtualLM.from_name(..., engine_opts={'enable_lora': True, 'max_lora_rank': <rank>})"
            )
        self.engine.add_lora(self._lora_request(adapter))
        self._loaded[adapter.name] = adapter

    def unload_adapter(self, adapter: Adapter) -> None:
        """Close ``adapter``'s sessions and drop its weights (its prefix-cache blocks are keyed by its id)."""
        doomed = [request for request in self._sessions if request.adapter == adapter]
        self._close_sessions([self._sessions.pop(request) for request in doomed])
        self.engine.remove_lora(adapter.version)
        if self._loaded.get(adapter.name) == adapter:
            del self._loaded[adapter.name]

    # ------------------------------------------------------------------ plumbing

    def _as_rows(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Captured ``[B, V_model]`` log-probabilities as ``[B, vocab_size]`` float32 rows on
        :attr:`device`: as captured (already normalized, a plain tensor made for them) where the
        model has exactly the vocabulary's columns, else fitted to it (:func:`fit_to_vocab`)."""
        if logprobs.shape[-1] != self.vocab_size:
            logprobs = fit_to_vocab(logprobs, self.vocab_size)
        return logprobs.to(self.device)

    def _take_logprobs(self, capture_ids: list[str]) -> torch.Tensor:
        replies = [r for r in self._rpc("genlm_take_logprobs", capture_ids) if r is not None]
        if not replies:
            raise CaptureError("no worker returned the captured log-probabilities")
        return replies[0]

    def _rpc(self, method: str, *args):
        return self.engine.collective_rpc(method, args=args)

    def clear(self) -> None:
        if self.engine is not None:
            self.close_sessions()
            self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and free its memory, so another engine can start here. Idempotent."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        try:
            engine.collective_rpc("genlm_release_store")
        finally:
            engine.engine_core.shutdown()
            del engine
            gc.collect()
            vllm_compat.cleanup_process_state()


def _parent(request: Request) -> Request:
    """The request one token shorter, under the same adapter (the one whose session it extends).

    Built from ``request.parent``, the tuple an earlier request held, when the
    front knows it: a session's key then compares by identity, not token by token.
    """
    parent = request.parent if request.parent is not None else request.context[:-1]
    return Request(request.adapter, parent)
