"""Full-vocabulary log-probabilities out of vLLM's sampler, one row per request id.

vLLM hands every step's logits, ``[num_rows, vocab]`` in float32 and before
temperature, to the custom logits processors of its sampler. A capture
processor takes the rows of the requests whose ``SamplingParams.extra_args``
carry :data:`REQUEST_ID_ARG`, applies ``log_softmax`` to them as one batched op
and files each row under that request id in the worker's :class:`CaptureStore`.
It never changes the logits. The backend fetches the rows with
``collective_rpc`` through :class:`CaptureWorkerExtension`.

Rows are filed by request id, never by position in a batch, so a batch that
vLLM's scheduler splits over several steps (long prompts prefilled in chunks,
more requests than ``max_num_seqs``) is still mapped right: a row is kept only
at the step where its request's whole prompt has been run.

Two processor interfaces exist and the one matching the engine's model runner
is installed by :func:`install_capture`:

* :class:`CaptureLogitsProcessor`: the V1 model runner (CPU, and GPUs when
  ``VLLM_USE_V2_MODEL_RUNNER=0``), ``vllm.v1.sample.logits_processor``;
* :class:`CaptureLogitsProcessorV2`: Model Runner V2 (the GPU default from
  vLLM 0.33), ``vllm.v1.worker.gpu.sample.logits_processor``.

Nothing here uses asyncio; everything runs in the engine's worker.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from genlm_backend.errors import CaptureError

try:  # Model Runner V2's interface (vLLM >= 0.32).
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor
except ImportError:  # pragma: no cover - older vLLM
    V2LogitsProcessor = None

REQUEST_ID_ARG = "genlm_request_id"
"""Key of ``SamplingParams.extra_args`` naming the request whose row is captured."""
STORE_ID_ARG = "genlm_capture_store"
"""Key of ``VllmConfig.additional_config`` naming the engine's store in its worker process."""
EXTENSION_CLS = "genlm_backend.llm.vllm.capture.CaptureWorkerExtension"


class CaptureStore:
    """Captured log-probability rows of one engine, by request id (one per worker process).

    The rows one processor call captures are one fresh ``[n, V]`` float32
    block, a plain tensor (not an inference-mode one: whoever takes it may
    hand its rows out to be written); each request id maps to its row there.
    """

    def __init__(self):
        self._rows: dict[str, tuple[torch.Tensor, int]] = {}  # request id -> (block, row index)
        self._lock = threading.Lock()

    def put(self, request_ids: list[str], logits: torch.Tensor) -> torch.Tensor:
        """File ``log_softmax(logits[i])`` under ``request_ids[i]``; ``logits``: ``[n, V]``.
        Returns the block of the rows filed."""
        with torch.inference_mode(False):  # the sampler runs in inference mode
            block = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        torch.log_softmax(logits, dim=-1, dtype=torch.float32, out=block)  # [n, V] float32
        with self._lock:
            self._rows.update(
                (request_id, (block, row)) for row, request_id in enumerate(request_ids)
            )
        return block

    def take(self, request_ids: list[str]) -> torch.Tensor:
        """Remove and return the rows of ``request_ids`` as ``[len(request_ids), V]`` float32.

        When they are all the rows of one captured block, in this order (a
        batch that ran as one step), that block itself; else a new tensor.

        Raises:
            CaptureError: a request has no captured row.
        """
        with self._lock:
            missing = [r for r in request_ids if r not in self._rows]
            if missing:
                raise CaptureError(
                    f"no log-probabilities were captured for {len(missing)} of "
                    f"{len(request_ids)} requests (first: {missing[0]!r})"
                )
            found = [self._rows.pop(r) for r in request_ids]
        block = found[0][0]
        if len(found) == block.shape[0] and all(
            other is block and row == index for index, (other, row) in enumerate(found)
        ):
            return block
        return torch.stack([other[row] for other, row in found])

    def discard(self, request_ids: list[str] | None = None) -> None:
        """Drop the rows of ``request_ids`` (all rows when ``None``)."""
        with self._lock:
            if request_ids is None:
                self._rows.clear()
            for request_id in request_ids or ():
                self._rows.pop(request_id, None)

    @property
    def num_rows(self) -> int:
        return len(self._rows)


# Stores of the engines whose workers live in this process, by store id. A
# registry is needed because vLLM builds the processors and the worker itself.
_STORES: dict[str, CaptureStore] = {}
_STORES_LOCK = threading.Lock()


def store_for(vllm_config) -> CaptureStore:
    """The store of the engine ``vllm_config`` belongs to, created on first use.

    Raises:
        CaptureError: the config was not prepared by :func:`install_capture`.
    """
    store_id = _store_id(vllm_config)
    with _STORES_LOCK:
        return _STORES.setdefault(store_id, CaptureStore())


def release_store(store_id: str) -> None:
    """Forget an engine's store in this process (its rows are dropped)."""
    with _STORES_LOCK:
        _STORES.pop(store_id, None)


def num_live_stores() -> int:
    """Engines with a store in this process."""
    with _STORES_LOCK:
        return len(_STORES)


def _store_id(vllm_config) -> str:
    config = vllm_config.additional_config
    if not isinstance(config, dict) or STORE_ID_ARG not in config:
        raise CaptureError(
            "this vLLM engine was not built for log-probability capture; "
            "build it with AsyncVirtualLM.from_name or build_capture_engine"
        )
    return config[STORE_ID_ARG]


def install_capture(vllm_config) -> str:
    """Prepare an engine config for capture, before the engine is built; return its store id.

    Puts the capture processor matching the config's model runner first among
    the custom logits processors (so it sees the model's raw logits), sets the
    worker extension, and names a fresh store in ``additional_config``.

    Raises:
        ValueError: speculative decoding is on (vLLM rejects custom logits
            processors with it), or another worker extension is configured.
    """
    if vllm_config.speculative_config is not None:
        raise ValueError("AsyncVirtualLM does not support speculative decoding")
    parallel = vllm_config.parallel_config
    if parallel.worker_extension_cls not in ("", EXTENSION_CLS):
        raise ValueError(
            f"worker_extension_cls={parallel.worker_extension_cls!r} is set; "
            "AsyncVirtualLM needs its own worker extension"
        )
    if not isinstance(vllm_config.additional_config, dict):
        raise ValueError("additional_config must be a dict to carry the capture store id")
    processor: type
    if vllm_config.use_v2_model_runner:
        if V2LogitsProcessor is None:  # pragma: no cover - older vLLM
            raise ValueError("this vLLM has no Model Runner V2 logits-processor interface")
        processor = CaptureLogitsProcessorV2
    else:
        processor = CaptureLogitsProcessor
    model_config = vllm_config.model_config
    model_config.logits_processors = [processor, *(model_config.logits_processors or ())]
    parallel.worker_extension_cls = EXTENSION_CLS
    store_id = uuid.uuid4().hex
    vllm_config.additional_config[STORE_ID_ARG] = store_id
    return store_id


def _captured_request_id(params) -> str | None:
    extra_args = getattr(params, "extra_args", None)
    return extra_args.get(REQUEST_ID_ARG) if extra_args else None


def _put_rows(store: CaptureStore, logits: torch.Tensor, captured: list[tuple[int, str]]) -> None:
    """File the rows ``captured`` names, ``(row of logits, request id)`` in increasing rows."""
    request_ids = [request_id for _, request_id in captured]
    if len(captured) == logits.shape[0]:  # every row, in order (increasing and distinct)
        store.put(request_ids, logits)
        return
    rows = torch.tensor([row for row, _ in captured], device=logits.device)
    store.put(request_ids, logits[rows])


class CaptureLogitsProcessor(V1LogitsProcessor):
    """V1 model runner: files the log-softmax row of every request carrying a request id.

    A request with ``max_tokens=1`` has sampled nothing yet exactly while its
    prompt runs, so a row is filed only while the request's output is empty;
    the last such row (the prompt's final chunk) is the one kept.
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self._store = store_for(vllm_config)
        # batch index -> (request id, the request's live list of output token ids)
        self._requests: dict[int, tuple[str, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        # False puts it among the processors applied before temperature, for
        # greedy requests too.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._requests, batch_update, self._new_state)

    @staticmethod
    def _new_state(params, prompt_ids, output_ids) -> tuple[str, list[int]] | None:
        request_id = _captured_request_id(params)
        return None if request_id is None else (request_id, output_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # logits: [num_requests, V], row i = batch index i
        captured = sorted(
            (index, request_id)
            for index, (request_id, output_ids) in self._requests.items()
            if not output_ids
        )
        if captured:
            _put_rows(self._store, logits, captured)
        return logits


if V2LogitsProcessor is not None:

    class CaptureLogitsProcessorV2(V2LogitsProcessor):
        """Model Runner V2: files the row of a request at the step that ends its prompt.

        The step ends the prompt when the tokens visible to the sampled token
        (``ctx.seq_lens_upper_bound_np``, exact without speculative decoding)
        equal the prompt length.
        """

        def __init__(self, vllm_config, req_states):
            self._store = store_for(vllm_config)
            self._prompt_len = req_states.prompt_len.np  # [max_num_reqs], by request slot
            self._request_ids: dict[int, str] = {}  # request slot -> request id

        def add_request(self, req_idx: int, sampling_params) -> bool:
            request_id = _captured_request_id(sampling_params)
            if request_id is None:
                self._request_ids.pop(req_idx, None)
                return False
            self._request_ids[req_idx] = request_id
            return True

        def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
            # logits: [num_rows, V]; without speculative decoding row i = batch position i
            slots = ctx.idx_mapping_np.tolist()
            if logits.shape[0] != len(slots):
                raise CaptureError("log-probability capture does not support speculative decoding")
            seq_lens = ctx.seq_lens_upper_bound_np
            captured = [
                (row, self._request_ids[slot])
                for row, slot in enumerate(slots)
                if slot in self._request_ids and seq_lens[row] == self._prompt_len[slot]
            ]
            if captured:
                _put_rows(self._store, logits, captured)
            return logits

else:  # pragma: no cover - older vLLM
    CaptureLogitsProcessorV2 = None  # type: ignore[misc,assignment]


class CaptureWorkerExtension:
    """Mixed into vLLM's worker class; called through ``collective_rpc`` by name."""

    vllm_config: Any  # the worker's

    def genlm_take_logprobs(self, request_ids: list[str]) -> torch.Tensor | None:
        """The captured rows ``[len(request_ids), V]``, from the one worker that answers.

        That worker is the first tensor-parallel rank of the last pipeline
        stage (where the sampler runs); the others drop their copies and
        return ``None``.
        """
        store = store_for(self.vllm_config)
        if not _is_answering_rank():
            store.discard(request_ids)
            return None
        return store.take(request_ids)

    def genlm_discard_logprobs(self, request_ids: list[str] | None = None) -> None:
        """Drop captured rows (all of this engine's when ``None``)."""
        store_for(self.vllm_config).discard(request_ids)

    def genlm_release_store(self) -> None:
        """Forget this engine's store in the worker's process."""
        release_store(_store_id(self.vllm_config))


def _is_answering_rank() -> bool:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return get_tp_group().is_first_rank and get_pp_group().is_last_rank
