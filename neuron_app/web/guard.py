"""Slow clients cannot take the server's connections (issue 45, H1), nor its memory and disk through bodies (issue 52).

uvicorn's `limit_concurrency` counts every open connection, including one that has sent half a request and
nothing since: about 1,000 such sockets from one client made every request a 503, `/healthz` included. Here:

- `header_deadline` gives uvicorn's protocol (httptools, or h11 when httptools is missing) a deadline for a
  request's headers (`header_timeout_s`, from the connection's opening or from the first byte of its next request)
  and a cap on their bytes (`max_header_kb`, else a 431): either way the connection is closed. uvicorn's own cap is
  turned off;
- `Guard` (the outermost ASGI middleware) caps the requests in progress, that is connections whose headers
  are read: `max_connections` in all and `max_connections_per_address` per client address. Beyond either,
  a 503 with Retry-After at once. `/healthz` is answered before both caps, whatever the load;
- every request body, on every route the server answers, meets one policy as its bytes arrive (web/bodies.py):
  a deadline for the whole body (`body_timeout_s`, then 408 and the connection closed), the route's size cap
  (`BodyRules`; a route the table does not know gets the smallest, 413) and a cap on the body bytes one address
  has in flight (`address_body_mb`, 429 before a byte is read when the body declares its length). At
  `max_connections`, a new request takes the place of the oldest one still waiting for its body (which gets its
  408) instead of a 503: slow bodies cannot starve requests that have theirs.

The address is uvicorn's (X-Forwarded-For only from FORWARDED_ALLOW_IPS), as for every other per-address limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from neuron_app.errors import AppError
from neuron_app.settings import Settings
from neuron_app.web.bodies import BodyRules, Watch, answer, declared_length

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: Answered before the caps: the orchestrator's liveness probe must never meet a 503 from load.
ALWAYS_ANSWERED = ("/healthz",)
RETRY_AFTER_S = 2
MB = 1 << 20


class Guard:
    """ASGI middleware: requests in progress, in all and per address, and every body's policy (module docstring)."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.total_cap = settings.max_connections
        self.address_cap = settings.max_connections_per_address
        self.rules = BodyRules.for_settings(settings)
        self.body_timeout_s = settings.body_timeout_s
        self.address_body_cap = int(settings.address_body_mb * MB)
        self.in_progress = 0
        self.by_address: Counter[str] = Counter()
        self.body_bytes: Counter[str] = Counter()  # bytes of bodies in flight per address (Watch keeps it)
        self.arriving: dict[int, Watch] = {}  # requests waiting for their body, the oldest first
        self.refused = 0
        self.evicted = 0
        self.proxied_warned = settings.reachable_by_others

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        cap, declared = self.rules.cap(path, scope), declared_length(scope)
        if declared is not None and declared > cap:  # before a byte is read, on every route
            await answer(send, path, 413, f"the request body is larger than {cap} bytes")
            return
        if path in ALWAYS_ANSWERED:  # its body is never read
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("unknown", 0))[0]
        if not self.proxied_warned and any(name == b"x-forwarded-for" for name, _ in scope.get("headers", [])):
            self.proxied_warned = True
            log.warning(
                "a request came through a proxy (X-Forwarded-For) while the app counts itself as reachable only "
                "from this host: set NEURON_APP_BEHIND_PROXY=true so the page limit and the safety checker are on"
            )
        if self.in_progress >= self.total_cap and not self.evict_oldest_waiting():
            await self.refuse(send, f"the server has {self.total_cap} requests in progress; retry shortly")
            return
        if self.by_address[address] >= self.address_cap:
            await self.refuse(send, f"address {address} has {self.address_cap} requests in progress; retry shortly")
            return
        if declared and self.body_bytes[address] + declared > self.address_body_cap:
            message = f"address {address} has {self.body_bytes[address]} bytes of request bodies in flight"
            await answer(send, path, 429, f"{message}; retry shortly", retry_after=RETRY_AFTER_S)
            return
        watch = Watch(self, scope, receive, send, cap, address, asyncio.get_running_loop().time() + self.body_timeout_s)
        self.in_progress += 1  # the event loop's thread only: no lock
        self.by_address[address] += 1
        try:
            await self.app(scope, watch.receive, watch.send)
        except Exception:
            if not watch.cut:
                raise
            log.debug("a request cut at the door ended with an error", exc_info=True)  # it was told the client left
        finally:
            watch.close()
            self.in_progress -= 1
            self.by_address[address] -= 1
            if not self.by_address[address]:
                del self.by_address[address]

    def evict_oldest_waiting(self) -> bool:
        """At the cap: the oldest request blocked on its body's bytes is cut (408), and a new one takes its place."""
        for key, watch in self.arriving.items():
            if watch.blocked:
                del self.arriving[key]
                watch.evict()
                self.evicted += 1
                return True
        return False

    async def refuse(self, send: Send, message: str) -> None:
        self.refused += 1
        await answer(send, "", 503, message, retry_after=RETRY_AFTER_S)


def header_deadline(base: type, timeout_s: float, max_header_bytes: int = 64 << 10) -> type:
    """A subclass of uvicorn's protocol (httptools or h11) that closes a connection whose request headers take over
    `timeout_s`, or answers 431 and closes one whose headers pass `max_header_bytes` (row 38: 100 MB of headers
    were read whole). A body left unread after its answer (a 413 or 429 from the Guard) is drained for at most
    `timeout_s`, then the connection is closed."""
    parser_hooks = hasattr(base, "on_headers_complete")  # httptools says where headers begin and end; h11 does not

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _in_headers = False
        _header_bytes = 0
        _discarding = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._begin()

        def on_message_begin(self) -> None:  # httptools only
            super().on_message_begin()
            self._begin()

        def on_headers_complete(self) -> None:  # httptools only
            self._end()
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            if self._discarding:
                return  # after a 431: read and dropped until the close, so the close resets nothing unread
            if not parser_hooks and self.conn.their_state is not _h11_send_body():
                self._begin()  # h11: bytes before a request's body are its headers
            if self._in_headers:  # counted before the parser sees them (h11 would answer its own 400 at 16 KiB)
                end = data.find(b"\r\n\r\n")
                if self._header_bytes + (len(data) if end < 0 else end) > max_header_bytes:
                    self._too_large()
                    return
            before = self.cycle
            super().data_received(data)
            if not parser_hooks and self.cycle is not before:
                self._end()
            if self._in_headers:
                self._header_bytes += len(data)

        def on_response_complete(self) -> None:
            before = self.cycle
            super().on_response_complete()
            if self.cycle is not before:
                self._end()  # h11: a pipelined request's headers were read
            elif before is not None and before.more_body and self._deadline is None:
                self._deadline = self.loop.call_later(timeout_s, self._too_slow)  # draining an unread body

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _begin(self) -> None:
            if not self._in_headers:
                self._in_headers, self._header_bytes = True, 0
                if self._deadline is None:
                    self._deadline = self.loop.call_later(timeout_s, self._too_slow)

        def _end(self) -> None:
            self._in_headers = False
            self._disarm()

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def _too_large(self) -> None:
            """431, then our side shut (the client reads the answer and the end), the rest dropped until the
            deadline closes: closing with the client's bytes unread would reset the connection before it read."""
            self._end()
            if self.transport.is_closing():
                return
            self._discarding = True
            self.transport.write(TOO_LARGE)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._deadline = self.loop.call_later(timeout_s, self._too_slow)

    HeaderDeadline.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline


TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def _h11_send_body() -> Any:
    import h11

    return h11.SEND_BODY


def guard_connections(demo: Any, settings: Settings) -> type:
    """On the launched server: the header deadline and cap on every new connection, and uvicorn's connection cap
    off (Guard counts requests in progress instead). Without httptools (or with a protocol this does not know)
    the deadline is on uvicorn's h11 protocol; a server that is not uvicorn's is refused: never unprotected."""
    config = getattr(getattr(demo, "server", None), "config", None)
    if config is None or not hasattr(config, "http_protocol_class"):
        raise AppError("the web server is not uvicorn's: the header deadline cannot be set")
    config.limit_concurrency = None
    from uvicorn.protocols.http.h11_impl import H11Protocol

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        known: tuple[type, ...] = (HttpToolsProtocol, H11Protocol)
    except ImportError:  # httptools is in requirements-common.txt; uvicorn alone runs on h11
        known = (H11Protocol,)
    current = getattr(config, "http_protocol_class", None)
    if not (isinstance(current, type) and issubclass(current, known)):
        log.warning("uvicorn's protocol %r is not one the header deadline knows: serving with h11", current)
        current = H11Protocol
    config.http_protocol_class = header_deadline(current, settings.header_timeout_s, settings.max_header_kb << 10)
    return config.http_protocol_class
