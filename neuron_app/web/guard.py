"""Slow clients cannot take the server's connections (issue 45, H1).

uvicorn's `limit_concurrency` counts every open connection, including one that has sent half a request and
nothing since: about 1,000 such sockets from one client made every request a 503, `/healthz` included. Here:

- `header_deadline` gives uvicorn's protocol a deadline for a request's headers (`header_timeout_s`, from the
  connection's opening or from the first byte of its next request): a connection still sending them is closed.
  uvicorn's own cap is turned off;
- `Guard` (the outermost ASGI middleware) caps the requests in progress, that is connections whose headers
  are read: `max_connections` in all and `max_connections_per_address` per client address. Beyond either,
  a 503 with Retry-After at once. `/healthz` is answered before both caps, whatever the load.

The address is uvicorn's (X-Forwarded-For only from FORWARDED_ALLOW_IPS), as for every other per-address limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from neuron_app.settings import Settings

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: Answered before the caps: the orchestrator's liveness probe must never meet a 503 from load.
ALWAYS_ANSWERED = ("/healthz",)
RETRY_AFTER_S = 2


class Guard:
    """ASGI middleware: requests in progress, in all and per address (see the module docstring)."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.total_cap = settings.max_connections
        self.address_cap = settings.max_connections_per_address
        self.in_progress = 0
        self.by_address: Counter[str] = Counter()
        self.refused = 0
        self.proxied_warned = settings.reachable_by_others

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in ALWAYS_ANSWERED:
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("unknown", 0))[0]
        if not self.proxied_warned and any(name == b"x-forwarded-for" for name, _ in scope.get("headers", [])):
            self.proxied_warned = True
            log.warning(
                "a request came through a proxy (X-Forwarded-For) while the app counts itself as reachable only "
                "from this host: set NEURON_APP_BEHIND_PROXY=true so the page limit and the safety checker are on"
            )
        if self.in_progress >= self.total_cap:
            await self.refuse(send, f"the server has {self.total_cap} requests in progress; retry shortly")
            return
        if self.by_address[address] >= self.address_cap:
            await self.refuse(send, f"address {address} has {self.address_cap} requests in progress; retry shortly")
            return
        self.in_progress += 1  # the event loop's thread only: no lock
        self.by_address[address] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1
            self.by_address[address] -= 1
            if not self.by_address[address]:
                del self.by_address[address]

    async def refuse(self, send: Send, message: str) -> None:
        self.refused += 1
        body = json.dumps({"detail": message, "error": message}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def header_deadline(base: type, timeout_s: float) -> type:
    """A subclass of uvicorn's httptools protocol that closes a connection whose headers take over `timeout_s`."""

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    HeaderDeadline.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline


def guard_connections(demo: Any, settings: Settings) -> bool:
    """On the launched server: the header deadline on every new connection, and uvicorn's connection cap off
    (Guard counts requests in progress instead). False, with a warning, when the server is not uvicorn's
    httptools protocol (then only Guard's caps hold)."""
    config = getattr(getattr(demo, "server", None), "config", None)
    if config is None or not hasattr(config, "limit_concurrency"):
        log.warning("the web server has no uvicorn config: no header deadline")
        return False
    config.limit_concurrency = None
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        log.warning("httptools is not installed: no header deadline (install uvicorn[standard])")
        return False
    current = getattr(config, "http_protocol_class", None)
    if not (isinstance(current, type) and issubclass(current, HttpToolsProtocol)):
        log.warning("uvicorn does not use httptools here: no header deadline")
        return False
    config.http_protocol_class = header_deadline(current, settings.header_timeout_s)
    return True
