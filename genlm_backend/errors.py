"""Every exception genlm_backend raises on purpose, each saying when it is raised."""


class GenlmBackendError(Exception):
    """Base class of the library's own exceptions."""


class BatcherClosedError(GenlmBackendError, RuntimeError):
    """Raised for a request submitted to, or still pending in, a closed batcher.

    Raised by ``await`` on any request that was queued when ``aclose()`` ran
    and by any request made after it.
    """


class BatcherWorkerDiedError(BatcherClosedError):
    """Raised for the requests of a batcher whose worker task stopped on an unexpected error.

    Every request pending in that batcher, and any later one submitted to it,
    gets this error; its ``__cause__`` is the worker's error. The backends and
    the async trie then serve their next request with a fresh batcher.
    """


class BackendNotAvailableError(GenlmBackendError, ImportError):
    """Raised when an optional backend (e.g. vLLM) is asked for but not installed.

    The message names the package to install.
    """


class AssetFetchError(GenlmBackendError, RuntimeError):
    """Raised when a model or tokenizer asset cannot be fetched from its registry.

    The message names the registry command that failed and how to provide the
    asset offline.
    """


class ModelNotFoundError(GenlmBackendError, FileNotFoundError):
    """Raised when a model name resolves to nothing loadable.

    Raised at once for a path that does not exist; for any other name, after
    the local Hugging Face cache and one short request to the hub. The message
    says what was tried and how to point at a local model.
    """


class VocabularyDecodeError(GenlmBackendError, ValueError):
    """Raised when the bytes of a token cannot be recovered from its tokenizer.

    The message names the tokenizer class and the first token that failed.
    """


class BackendClosedError(BatcherClosedError):
    """Raised by any request to an :class:`~genlm_backend.llm.base.AsyncLM` after ``aclose()``/``close()``."""


class CaptureError(GenlmBackendError, RuntimeError):
    """Raised by the vLLM backend when the engine returned no log-probabilities for a request.

    Fails only the batch it concerns; the message says how many rows were missing.
    """


class ServerUnavailableError(GenlmBackendError, ConnectionError):
    """Raised by a :class:`~genlm_backend.serve.RemoteLM` call when its server cannot answer.

    Raised when the server cannot be reached (within the client's
    ``connect_timeout_s``), closes the connection mid-request (it stopped or
    crashed), gives no answer within ``read_timeout_s``, or fails the request
    because it is shutting down. Every request of the round trip concerned
    gets it; the next call connects afresh, so a server that comes back is
    used again without rebuilding the client.
    """


class ServerRejectedError(GenlmBackendError, PermissionError):
    """Raised by a :class:`~genlm_backend.serve.RemoteLM` whose server refused its token.

    The message says whether a token was sent; the server's token comes from
    ``GENLM_SERVE_TOKEN`` or ``--token-file`` (see ``genlm-backend serve --help``).
    """


class RequestTooLargeError(GenlmBackendError, ValueError):
    """Raised when a request to a ``genlm-backend serve`` server exceeds one of its limits.

    The limits are rows per request, tokens per context and body bytes; the
    message names the limit and the value sent. Only that request fails.
    """


class RemoteModelError(GenlmBackendError, RuntimeError):
    """Raised by a :class:`~genlm_backend.serve.RemoteLM` when the server's model failed its batch.

    The message carries the server-side exception's class and message (e.g.
    an out-of-memory error); only the requests of that batch fail.
    """


class ServerModelChangedError(ServerUnavailableError):
    """Raised when a :class:`~genlm_backend.serve.RemoteLM` reconnects to a server with another model.

    The client's vocabulary and cached rows belong to the model it first
    connected to; build a new client for the new one.
    """
