"""A request's trace at the HTTP entry (the OpenAI API's routes): a server span, continued from the caller's
`traceparent` if it sent one, and the answer's `traceparent` header, so a caller can find its trace."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from neuron_app import tracing

Endpoint = Callable[[Request], Awaitable[Response]]


def traced(endpoint: Endpoint) -> Endpoint:
    """`endpoint` inside a span named after the route; a no-op while tracing is off."""

    async def wrapper(request: Request) -> Response:
        if not tracing.enabled():
            return await endpoint(request)
        name = f"{request.method} {request.url.path}"
        with tracing.attached(dict(request.headers)), tracing.span(name, kind="server", entry="openai") as span:
            header = tracing.traceparent()
            response = await endpoint(request)
            span.set_attribute("http.response.status_code", response.status_code)
        if header:
            response.headers["traceparent"] = header
        return response

    return wrapper
