"""One error family for the whole app, and errors as one line for users and logs.

Every error a caller can meet is an `AppError` carrying what the callers need as data, set where the
check is made: `kind` (refused: the request was wrong and cost nothing; unavailable: try again later or
elsewhere; failed: the work itself broke) and `param` (the request field it is about, or None). The page,
the OpenAI-compatible API, MCP and the replicas' client read these fields, never the message text.

Torch-free and import-free: every module may import it.
"""

from __future__ import annotations

import errno
from typing import ClassVar, Literal

Kind = Literal["refused", "unavailable", "failed"]


class AppError(Exception):
    """Base of every error this app raises on purpose; the message is for people, the fields for code."""

    kind: ClassVar[Kind] = "failed"
    #: HTTP status for the OpenAI-compatible API (and the status code of a job that ends this way).
    http_status: ClassVar[int] = 500
    #: The machine-readable code when the raise site names none (OpenAI's `error.code`).
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code if code is not None else self.default_code

    @property
    def message(self) -> str:
        return str(self)

    def __reduce__(self) -> tuple:  # survives pickling (Ray, multiprocessing) with its fields
        return (_rebuild, (type(self), str(self), self.param, self.code))


def _rebuild(cls: type[AppError], message: str, param: str | None, code: str | None) -> AppError:
    return cls(message, param=param, code=code)


# --- refused: the caller asked for something the app does not offer; nothing was spent --------------------
class RequestError(AppError, ValueError):
    """A request the UI would not offer; refused before any model work."""

    kind = "refused"
    http_status = 400
    default_code = "invalid_value"


class ShapeError(RequestError):
    """A shape string that is not a valid "WIDTHxHEIGHT"."""

    def __init__(self, message: str = "", *, param: str | None = "resolution", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)


class ContentRefused(RequestError):
    """The prompt or the image is against this server's content policy (blocked terms, the safety checker)."""

    def __init__(
        self, message: str = "", *, param: str | None = "prompt", code: str | None = "content_policy_violation"
    ) -> None:
        super().__init__(message, param=param, code=code)


class RateLimited(AppError):
    """A caller over its images-per-minute or per-day limit; `retry_after_s` says when to come back."""

    kind = "refused"
    http_status = 429

    def __init__(
        self, message: str = "", *, param: str | None = None, code: str | None = "rate_limit_exceeded",
        retry_after_s: float = 60.0,
    ) -> None:  # fmt: skip
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple:
        return (_rebuild_rate, (str(self), self.param, self.code, self.retry_after_s))


def _rebuild_rate(message: str, param: str | None, code: str | None, retry_after_s: float) -> RateLimited:
    return RateLimited(message, param=param, code=code, retry_after_s=retry_after_s)


class NotFound(AppError):
    """No such thing for this caller (an unknown job id, or another key's job): nothing is said about which."""

    kind = "refused"
    http_status = 404
    default_code = "not_found"


class Conflict(AppError):
    """The request is valid but not in the thing's current state (cancelling a job that already runs)."""

    kind = "refused"
    http_status = 409
    default_code = "conflict"


class Cancelled(AppError):
    """Its caller stopped it (DELETE on a running job, the page's Stop): it ended at the next denoising step, and
    its images were never kept. Raised by the caller's progress callback, inside the pipeline's step callback."""

    kind = "refused"
    http_status = 409
    default_code = "cancelled"


# --- unavailable: the server cannot take it now ------------------------------------------------------
class Unavailable(AppError):
    """The server cannot do it now (loading, shutting down, no device); the caller may retry later."""

    kind = "unavailable"
    http_status = 503
    default_code = "unavailable"


class StorageFull(Unavailable):
    """The disk is full (ENOSPC, or a quota): nothing could be written; the caller may retry later."""

    http_status = 507
    default_code = "insufficient_storage"


#: errno values of a full disk or quota: an OSError with one of them is a `StorageFull`.
_FULL = (errno.ENOSPC, errno.EDQUOT)


class ShuttingDown(Unavailable):
    """The server is draining for shutdown: new device work is refused with a clear message."""

    default_code = "shutting_down"


class DeviceUnavailable(Unavailable, RuntimeError):
    """The chosen device cannot be used here; the message says what to do."""


class ModelLoadError(Unavailable, RuntimeError):
    """The model could not be loaded; the message says why and what to do."""

    default_code = "model_unavailable"


class LoraError(ModelLoadError):
    """A LoRA style that cannot be used (bad file, rank too high, wrong model)."""


class SettingsError(AppError, RuntimeError):
    """Settings that cannot work; the message names the field and where it came from."""

    kind = "unavailable"
    http_status = 500


# --- failed: the work itself broke -------------------------------------------------------------------
class CompileFailed(AppError, RuntimeError):
    """Compiling a shape failed; remembered per graph and retried on the next request."""

    default_code = "generation_failed"


class GenerationFailed(AppError, RuntimeError):
    """The pipeline call failed after its shape was ready (e.g. out of memory); only this request is lost."""

    default_code = "generation_failed"


class LockstepError(AppError, RuntimeError):
    """Tensor-parallel ranks disagreed or one of them died; the group is broken."""


class NeuronRuleViolation(AppError, RuntimeError):
    """Device work that TorchNeuron would refuse (or silently move to the CPU), caught by the emulator."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line` of the root cause; wrappers such as dynamo's BackendCompilerFailed hide it."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {(text[0] if text else '')[:limit]}"


def app_error_of(exc: BaseException) -> AppError | None:
    """The `AppError` behind `exc` (itself, a cause, or Ray's `.cause`), or None.

    Ray re-raises a remote error as a `RayTaskError` that is also an instance of the original class but whose
    text is the remote traceback: its `.cause` (the original, unpickled with its fields) is preferred."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        remote = getattr(current, "cause", None)
        if isinstance(remote, BaseException):
            current = remote
            continue
        if isinstance(current, AppError):
            return current
        if isinstance(current, OSError) and current.errno in _FULL:  # never the path: it is the server's
            return StorageFull("the server's disk is full: nothing could be saved; try again later")
        current = current.__cause__
    return None


def rule_of(exc: BaseException) -> NeuronRuleViolation | None:
    """The emulator's rule violation behind `exc` (dynamo wraps errors raised while it compiles)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, NeuronRuleViolation):
            return current
        seen.add(id(current))
        current = getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
    return None


def unprintable(text: str) -> str | None:
    """The first character of `text` a terminal or a log would act on rather than show, or None: C0 and C1
    controls (escape sequences, a newline that forges a row, `\\r`), and the bidirectional overrides and isolates
    that reorder what follows (red-team turn 7, row 23)."""
    return next((c for c in text if _acts(c)), None)


def escape_cell(text: str) -> str:
    """`text` with every character `unprintable` finds written as its escape (`\\x1b`, `\\n`, `\\u202e`)."""
    return "".join(c.encode("unicode_escape").decode("ascii") if _acts(c) else c for c in text)


def _acts(c: str) -> bool:
    return not c.isprintable() and c not in JOINERS  # Cc, Cf (bidi among them), line and paragraph separators


#: Format characters that only join what they stand between (emoji sequences, Persian and Indic words).
JOINERS = "\u200c\u200d"
