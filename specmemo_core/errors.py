"""Exceptions the engine raises. Each message tells the user what to do next."""

from __future__ import annotations


class SpecMemoError(Exception):
    """Base class: anything the app can show the user as a plain message."""


class ModelFileError(SpecMemoError):
    """A model file or folder is missing, truncated, corrupt or of an unknown kind."""

    def __init__(self, path: object, problem: str, fix: str) -> None:
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        super().__init__(f"{self.path}: {problem}. {fix}")


class FetchError(SpecMemoError):
    """Downloading the default model (or a data set) failed; nothing was left in the cache."""


class HeadsError(SpecMemoError):
    """Draft heads are unreadable, unsafe, or were made for another model."""


class TreeError(SpecMemoError):
    """A speculation tree name or file is invalid."""


class ContextFullError(SpecMemoError):
    """The conversation no longer fits the KV cache that was allocated for it."""


class OutOfMemoryError(SpecMemoError):
    """The device ran out of memory during a reply (torch's OutOfMemoryError or Python's MemoryError,
    converted where a reply runs). The conversation is kept; a smaller plan (context, tree) may fit."""


class LowMemoryError(SpecMemoError):
    """The computer ran out of memory (RAM) while loading the model; nothing on disk was changed."""


class ChatTemplateError(SpecMemoError):
    """The model's chat template failed, or ran past its step or output budget (a runaway loop)."""


class OffloadError(SpecMemoError):
    """Decoder layers cannot be streamed from host memory as planned (offload.py)."""


class SplitError(SpecMemoError):
    """A model cannot be split over the devices asked for (runtime/split.py, planning/split.py), or
    ``--devices`` names devices that are not there; the message says what would fit or what to type."""


class BatchError(SpecMemoError):
    """A batch decoder was asked for something it cannot do (runtime/batch.py); the message says what to change."""


class BatchFullError(BatchError):
    """Every slot of a batch decoder holds a sequence: wait for one to finish, or remove one."""


class PromptTooLongError(BatchError):
    """A prompt does not fit one batch slot's KV capacity."""


class RequestError(SpecMemoError):
    """A request to the local server (``specmemo serve``) that is refused: the HTTP ``status``, and
    OpenAI's error ``kind`` (its JSON ``type``) and ``code``, so any OpenAI client shows the message."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        self.code = code
        self.param = param
        super().__init__(message)


class ServerBusyError(RequestError):
    """Every decoding slot is busy and the queue of waiting requests is full: try again shortly."""

    status = 429
    kind = "rate_limit_error"


class InvalidApiKeyError(RequestError):
    """The server was started with ``--api-key`` and the request's key is missing or another."""

    status = 401
    kind = "authentication_error"


class UnknownModelError(RequestError):
    """The request names a model this server does not serve."""

    status = 404


class RequestTooLargeError(RequestError):
    """The request body is larger than the server reads."""

    status = 413


class ServeError(SpecMemoError):
    """The local server cannot start (its port is taken, its address cannot be bound)."""
