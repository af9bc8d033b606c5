"""OpenAI's error shape, read from the app's error family (errors.py): status, type, param and code, never text;
and the body read with its 413."""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from neuron_app.errors import AppError, RateLimited, app_error_of, one_line

log = logging.getLogger("neuron_app.web.openai.routes")

#: OpenAI's name of a request field, by the `param` an error carries (set where engine/requests.py checks it).
PARAM_OF = {
    "resolution": "size",
    "steps": "num_inference_steps",
    "references": "image",
}


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """OpenAI's error object (also what a failed job shows)."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=self.headers)


def refusal(exc: AppError) -> ApiError:
    """An app error as OpenAI reports it, from its fields: status, type, the field it is about (OpenAI's name)
    and its code; the message is the app's own."""
    headers, type_ = None, "invalid_request_error" if exc.kind == "refused" else "server_error"
    if isinstance(exc, RateLimited):
        headers, type_ = {"Retry-After": str(max(1, round(exc.retry_after_s)))}, "rate_limit_error"
    elif exc.http_status == 503:
        headers = {"Retry-After": "5"}
    param = PARAM_OF.get(exc.param, exc.param) if exc.param else None
    return ApiError(exc.http_status, str(exc), type=type_, param=param, code=exc.code, headers=headers)


def failure(exc: Exception) -> ApiError:
    """Anything raised by `generate`: an app error from its fields, else a 500 with a one-line reason."""
    known = app_error_of(exc)
    if known is not None:
        return refusal(known)
    log.exception("unexpected error in the OpenAI-compatible API")
    return ApiError(500, one_line(exc, limit=200), type="server_error")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 beyond `limit` bytes (declared or actually sent)."""
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
