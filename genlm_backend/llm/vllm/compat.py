"""Every use of vLLM's internals, checked against the installed version at construction.

Here: building the engine (``LLMEngine.from_vllm_config`` after the capture
processor is installed in its config), and the particle sessions, which drive
the in-process engine core directly: its scheduler
(``engine_core.engine_core.scheduler``), streaming-input requests
(``resumable=True``, ``RequestStatus.WAITING_FOR_STREAMING_REQ``) and
``EngineCoreRequest.external_req_id``. In :mod:`.capture`, the half that runs
inside vLLM's worker: the logits processors (both of vLLM's interfaces) and
the worker extension. These are known to work with the versions in
:data:`SUPPORTED_VLLM`; :func:`check_vllm_version` raises a clear error elsewhere.
"""

from __future__ import annotations

SUPPORTED_VLLM = ((0, 32), (0, 34))
"""vLLM versions ``[low, high)`` (major, minor) whose internals this module was written against."""


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``ImportError`` unless vLLM's (major, minor) version is in :data:`SUPPORTED_VLLM`.

    Args:
        version: The version to check; the installed one when omitted.
    """
    if version is None:
        import vllm

        version = vllm.__version__
    major_minor = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    low, high = SUPPORTED_VLLM
    if not low <= major_minor < high:
        raise ImportError(
            f"AsyncVirtualLM needs vllm >={low[0]}.{low[1]},<{high[0]}.{high[1]} (it relies on engine "
            f"internals of those versions); found {version}. Install a supported version: "
            f"pip install 'vllm>={low[0]}.{low[1]},<{high[0]}.{high[1]}'"
        )


def build_capture_engine(engine_args):
    """A ``vllm.v1.engine.llm_engine.LLMEngine`` whose sampler captures log-probabilities.

    Args:
        engine_args: A ``vllm.EngineArgs``.

    Raises:
        ValueError: options the capture path cannot serve (see
            :func:`~genlm_backend.llm.vllm.capture.install_capture`).
    """
    from vllm.v1.engine.llm_engine import LLMEngine

    from genlm_backend.llm.vllm.capture import install_capture

    vllm_config = engine_args.create_engine_config()
    install_capture(vllm_config)
    return LLMEngine.from_vllm_config(vllm_config, disable_log_stats=True)


def sampling_params(capture_id: str):
    """One greedy token whose log-probability row is captured under ``capture_id``."""
    from vllm import SamplingParams

    from genlm_backend.llm.vllm.capture import REQUEST_ID_ARG

    return SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, extra_args={REQUEST_ID_ARG: capture_id}
    )


def add_plain_request(engine, request_id: str, context, lora_request) -> None:
    """A one-token request through the engine's public ``add_request``; its row is captured under its id."""
    from vllm.inputs.engine import tokens_input

    engine.add_request(
        request_id,
        tokens_input(list(context)),
        sampling_params(request_id),
        lora_request=lora_request,
    )


def add_scoring_request(engine, request_id: str, tokens, lora_request) -> None:
    """A request asking for the log-probability of each of its prompt tokens (``prompt_logprobs=0``).

    Its row is not captured: the scores come back in the engine's output
    (:func:`prompt_token_logprobs`), one value per token, not full rows.
    """
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=0)
    engine.add_request(request_id, tokens_input(list(tokens)), params, lora_request=lora_request)


def prompt_token_logprobs(output, tokens, start: int) -> list[float]:
    """The log-probability of ``tokens[i]`` for ``i >= start`` in a finished scoring request's output.

    Raises:
        CaptureError: the output holds no prompt log-probabilities for a position.
    """
    from genlm_backend.errors import CaptureError

    found = output.prompt_logprobs
    if found is None or len(found) < len(tokens):
        raise CaptureError("vLLM returned no prompt log-probabilities for a scoring request")
    return [found[i][tokens[i]].logprob for i in range(start, len(tokens))]


def add_session_request(
    engine, request_id: str, tokens, capture_id: str, resumable: bool, lora_request
) -> None:
    """Send ``tokens`` as a new request, or as the next input of the open session ``request_id``."""
    from vllm.inputs.engine import tokens_input

    request = engine.input_processor.process_inputs(
        request_id,
        tokens_input(list(tokens)),
        sampling_params(capture_id),
        supported_tasks=engine.get_supported_tasks(),
        resumable=resumable,
        lora_request=lora_request,
    )
    # These requests bypass the output processor (rows come from the capture
    # store), so the engine core gets each with its id as given.
    request.external_req_id = request.request_id
    engine.engine_core.add_request(request)


def is_busy(scheduler, request_id: str) -> bool:
    """Whether ``request_id`` is still running its turn (not finished, not an idle session)."""
    from vllm.v1.request import RequestStatus

    request = scheduler.requests.get(request_id)
    return request is not None and request.status != RequestStatus.WAITING_FOR_STREAMING_REQ


def sessions_unsupported(engine) -> str | None:
    """Why particle sessions cannot run on ``engine``, or ``None`` where they can.

    They drive the engine core's scheduler, so they need the engine core in
    this process; and the V1 model runner and one pipeline stage, the
    settings they were tested with (one worker, or several tensor-parallel
    workers: the scheduler is the same). Pipeline parallelism was never run:
    vLLM's CPU build fails on it in its own engine.
    """
    config = engine.vllm_config
    if _scheduler(engine) is None:
        return "the engine core runs in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1)"
    if config.use_v2_model_runner:
        return "the engine runs Model Runner V2"
    num_stages = config.parallel_config.pipeline_parallel_size
    if num_stages != 1:
        return f"the engine runs pipeline_parallel_size={num_stages}"
    return None


def in_process_scheduler(engine):
    """The scheduler particle sessions use, or ``None`` where they are not supported (see :func:`sessions_unsupported`)."""
    return None if sessions_unsupported(engine) is not None else _scheduler(engine)


def _scheduler(engine):
    core = getattr(engine.engine_core, "engine_core", None)
    return getattr(core, "scheduler", None)


def underlying_model(engine):
    """The torch model the engine's (single, in-process) worker runs.

    Raises:
        RuntimeError: the model runs in several workers, or the engine core or
            its worker is not in this process.
    """
    parallel = engine.vllm_config.parallel_config
    if parallel.world_size != 1:
        raise RuntimeError(
            f"the model runs in {parallel.world_size} worker processes "
            f"(tensor_parallel_size={parallel.tensor_parallel_size}, "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}); "
            "underlying_model needs one worker"
        )
    try:
        worker = engine.engine_core.engine_core.model_executor.driver_worker.worker
        return worker.model_runner.model
    except AttributeError as exc:
        raise RuntimeError(
            "the model is reachable only with the engine core in this process"
        ) from exc


def cleanup_process_state() -> None:
    """Tear down vLLM's process-wide distributed state once no capture engine is left."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from genlm_backend.llm.vllm.capture import num_live_stores

    if num_live_stores() == 0:
        cleanup_dist_env_and_memory()
