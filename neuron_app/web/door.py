"""The server's door: what every connection meets before Gradio or the OpenAI API see a request.

- Uploads (`POST /gradio_api/upload`, the page's and gradio_client's way to send a file) are limited in bytes per
  client address per minute (`upload_mb_per_minute`, 429) and for all addresses together per hour
  (`upload_total_mb`, 507: Gradio keeps an upload up to an hour, so this bounds the disk they take). An upload
  must declare its size (Content-Length; 411 otherwise): it is charged before a byte is read, and given back
  when Gradio refuses it. The address is uvicorn's (X-Forwarded-For only from FORWARDED_ALLOW_IPS), as for
  the page's image limit (web/access.py).
- A full Gradio queue answers 503 from `/gradio_api/queue/join` with no `Retry-After`: the door adds one.
- `cap_connections` sets uvicorn's `limit_concurrency` on the running server (503 beyond it). uvicorn 0.54 has
  no timeout for reading a request's headers (its keep-alive timer starts after a first answer), so a client
  that sends half a request holds its connection until the cap: docs/sharing.md says to put a proxy in front.

A pure ASGI middleware (`app_kwargs={"middleware": [...]}` reaches Gradio's FastAPI app): bodies stream through.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from neuron_app.errors import RateLimited, RequestError
from neuron_app.settings import Settings
from neuron_app.web.access import MINUTE_S, Limit, Limiter

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

HOUR_S = 3600.0
MB = 1 << 20
UPLOAD_PATHS = ("/gradio_api/upload", "/upload")
QUEUE_JOIN = "/gradio_api/queue/join"
#: What a full queue tells a client to wait (a generation takes seconds to a minute).
QUEUE_RETRY_AFTER_S = 5


async def _answer(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": message, "error": message}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Door:
    """ASGI middleware: upload budgets and the queue's Retry-After (see the module docstring)."""

    def __init__(self, app: Any, settings: Settings, limiter: Limiter | None = None) -> None:
        self.app = app
        self.limiter = limiter or Limiter()
        per_minute = int(settings.upload_mb_per_minute * MB)
        self.per_address = [Limit(per_minute, MINUTE_S, "per minute", "upload_bytes_per_minute", "bytes")]
        self.total = [Limit(int(settings.upload_total_mb * MB), HOUR_S, "per hour", "upload_bytes_per_hour", "bytes")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif scope.get("method") == "POST" and scope.get("path", "").rstrip("/") in UPLOAD_PATHS:
            await self.upload(scope, receive, send)
        elif scope.get("path", "").startswith(QUEUE_JOIN):
            await self.app(scope, receive, _retry_after_on_503(send))
        else:
            await self.app(scope, receive, send)

    async def upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        declared = headers.get("content-length", "")
        if not declared.isdigit():
            await _answer(send, 411, "an upload must declare its size (Content-Length)")
            return
        size = int(declared)
        address = (scope.get("client") or ("unknown", 0))[0]
        refunds = []
        try:
            refunds.append(self.limiter.charge(f"upload:{address}", size, self.per_address, f"address {address}"))
            refunds.append(self.limiter.charge("upload:*", size, self.total, "the upload space (all addresses)"))
        except (RateLimited, RequestError) as exc:
            for refund in refunds:
                refund()
            log.info("upload refused: %s", exc)
            if isinstance(exc, RequestError):
                await _answer(send, 413, str(exc))
            else:
                status = 429 if not refunds else 507
                await _answer(send, status, str(exc), {"Retry-After": str(max(1, round(exc.retry_after_s)))})
            return
        status: list[int] = []

        async def watch(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if not status or status[0] >= 400:  # refused by Gradio (too large, bad form) or cut off: not kept
                for refund in refunds:
                    refund()


def _retry_after_on_503(send: Send) -> Send:
    async def wrapped(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] == 503:
            headers = list(message.get("headers", []))
            if not any(name.lower() == b"retry-after" for name, _ in headers):
                headers.append((b"retry-after", str(QUEUE_RETRY_AFTER_S).encode()))
            message = {**message, "headers": headers}
        await send(message)

    return wrapped


def cap_connections(demo: Any, settings: Settings) -> bool:
    """uvicorn's `limit_concurrency` on the launched server: every connection made from now on reads it."""
    config = getattr(getattr(demo, "server", None), "config", None)
    if config is None or not hasattr(config, "limit_concurrency"):
        log.warning("the web server has no uvicorn config to cap connections on")
        return False
    config.limit_concurrency = settings.max_connections
    return True
