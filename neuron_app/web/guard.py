"""Slow clients cannot take the server's places (issues 45, 52, 57), nor its memory and disk through bodies.

- `header_deadline` gives uvicorn's protocol (httptools, or h11 without it) a deadline for a request's headers
  (`header_timeout_s`) and a cap on their bytes and on a chunked body's trailers (`max_header_kb`, else a 431):
  either way the connection is closed. An answer the client does not read for `send_timeout_s` closes it too, and
  a body left unread after an early answer is drained for at most `header_timeout_s` and DRAIN_BYTES;
- `Guard` (the outermost ASGI middleware) caps the requests in progress, headers read until the answer ends:
  `max_connections` in all, `max_connections_per_address` per address, else a 503 with Retry-After. Long-lived
  answers (event streams: Gradio's heartbeat and queue data, MCP, `stream=true`) are counted apart,
  `max_streams` and `max_streams_per_address`, the oldest ended at the cap: they never take a request's place.
  `/healthz` and `/readyz` are answered before the caps; with page auth on, the heartbeat asks for the login;
- every request body meets one policy as its bytes arrive (web/bodies.py): `body_timeout_s` (408 and a close),
  the route's cap (`BodyRules`, 413), the bytes one address has in flight (`address_body_mb`, 429). At
  `max_connections` a new request takes the place of the slowest one for its size that is blocked on its client
  (a body gets its 408, an unread answer its connection closed): an upload that makes progress is never cut.

The address is uvicorn's (X-Forwarded-For only from FORWARDED_ALLOW_IPS), as for every other per-address limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect

from neuron_app.settings import Settings
from neuron_app.web.access import gradio_login
from neuron_app.web.bodies import CLOSE_KEY, BodyRules, Watch, answer, declared_length

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: Answered before the caps: the orchestrator's probes must never meet a 503 from load (row 34: /readyz too).
ALWAYS_ANSWERED = ("/healthz", "/readyz")
#: GETs whose answers are long-lived by design: counted as streams from the start, never as requests in progress
#: (Gradio's heartbeat never ends; its queue data and MCP's streams last a run or a session).
STREAM_PATHS = ("/gradio_api/heartbeat/", "/gradio_api/queue/data", "/gradio_api/mcp")
HEARTBEAT = "/gradio_api/heartbeat/"
RETRY_AFTER_S = 2
MB = 1 << 20
#: At the request cap only a request below this rate (bytes per second since its headers, of its body while it
#: arrives, else of its answer) may be displaced, and only one blocked on its client: a 400 KB/s upload never is.
DISPLACE_BELOW_BPS = 16 << 10
#: A request's rate is taken over at least this long: one just admitted is not the slowest for having sent nothing.
RATE_GRACE_S = 2.0


class Guard:
    """ASGI middleware: requests in progress and long-lived answers, in all and per address, and every body's
    policy (module docstring)."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.total_cap = settings.max_connections
        self.address_cap = settings.max_connections_per_address
        self.stream_cap = settings.max_streams
        self.stream_address_cap = settings.max_streams_per_address
        self.rules = BodyRules.for_settings(settings)
        self.body_timeout_s = settings.body_timeout_s
        self.address_body_cap = int(settings.address_body_mb * MB)
        self.login_required = settings.auth is not None
        self.in_progress = 0
        self.by_address: Counter[str] = Counter()
        self.body_bytes: Counter[str] = Counter()  # bytes of bodies in flight per address (Watch keeps it)
        self.arriving: dict[int, Watch] = {}  # requests waiting for their body, the oldest first
        self.places: dict[int, Watch] = {}  # every request in progress (not the streams), the oldest first
        self.streams: dict[int, Watch] = {}  # long-lived answers open, the oldest first
        self.streams_by_address: Counter[str] = Counter()
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
        if self.login_required and path.startswith(HEARTBEAT) and not gradio_login(scope):
            await answer(send, path, 401, "Not authenticated")  # Gradio asks no login of its heartbeat (row 34)
            return
        stream = scope.get("method") == "GET" and path.startswith(STREAM_PATHS)
        if not stream:
            if self.in_progress >= self.total_cap and not self.displace_slowest():
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
        if stream:
            self.open_stream(watch)
        else:
            self.in_progress += 1  # the event loop's thread only: no lock
            self.by_address[address] += 1
            self.places[id(watch)] = watch
        try:
            await self.app(scope, watch.receive, watch.send)
        except Exception as exc:
            if not (watch.cut or isinstance(exc, ClientDisconnect)):
                raise
            log.debug("a request cut at the door, or left, ended with an error", exc_info=True)  # told the client left
        finally:
            watch.close()
            self.release(watch)

    def release(self, watch: Watch) -> None:
        """Its place (a request in progress, or a stream) given back, once."""
        if not watch.counted:
            return
        watch.counted = False
        counts = self.streams_by_address if watch.stream else self.by_address
        if watch.stream:
            self.streams.pop(id(watch), None)
        else:
            self.places.pop(id(watch), None)
            self.in_progress -= 1
        counts[watch.address] -= 1
        if counts[watch.address] <= 0:
            del counts[watch.address]

    def open_stream(self, watch: Watch) -> None:
        """Counted as a long-lived answer; at the address's cap its own oldest is ended, at the total cap the
        oldest of the address with the most (a stream never takes a request's place, nor waits for one)."""
        address = watch.address
        if self.streams_by_address[address] >= self.stream_address_cap:
            victim = next((w for w in self.streams.values() if w.address == address), None)
        elif len(self.streams) >= self.stream_cap:
            most = max(self.streams_by_address, key=self.streams_by_address.__getitem__)
            victim = next((w for w in self.streams.values() if w.address == most), None)
        else:
            victim = None
        if victim is not None:
            log.info("a long-lived answer of %s ended at the stream cap for a new one", victim.address)
            self.release(victim)
            victim.evict()
            self.evicted += 1
        watch.stream = True
        self.streams[id(watch)] = watch
        self.streams_by_address[address] += 1

    def to_stream(self, watch: Watch) -> None:
        """A request whose answer turned out an event stream (`stream=true`, an MCP call's progress): its request
        place is given back, and it is counted as a stream."""
        if watch.counted and not watch.stream:
            self.release(watch)
            watch.counted = True
            self.open_stream(watch)

    def displace_slowest(self) -> bool:
        """At the cap: the slowest request for its size that is blocked on its client (a body arriving below
        DISPLACE_BELOW_BPS since its headers, or an answer whose send has waited RATE_GRACE_S for the client to read)
        is cut (a body still arriving gets a 408, an unread answer its connection closed), and a new one takes its
        place: one younger than RATE_GRACE_S only when no older one is left, and
        the address with the most requests in progress first (a flood's, not the one upload of a user)."""
        now = asyncio.get_running_loop().time()
        best, best_key = None, None
        for watch in self.places.values():
            if watch.writing:  # the kernel's buffers took megabytes at once: a send blocked this long is a stall
                if now - watch.write_since < RATE_GRACE_S:
                    continue
                rate = 0.0
            elif watch.blocked and not watch.done:
                rate = watch.rate(now, RATE_GRACE_S)
                if rate >= DISPLACE_BELOW_BPS:
                    continue
            else:
                continue
            key = (now - watch.began < RATE_GRACE_S, -self.by_address[watch.address], rate, watch.began)
            if best_key is None or key < best_key:
                best, best_key = watch, key
        if best is None:
            return False
        self.arriving.pop(id(best), None)
        self.release(best)
        best.evict()
        self.evicted += 1
        return True

    async def refuse(self, send: Send, message: str) -> None:
        self.refused += 1
        await answer(send, "", 503, message, retry_after=RETRY_AFTER_S)


def header_deadline(
    base: type, timeout_s: float, max_header_bytes: int = 64 << 10, send_timeout_s: float = 30.0
) -> type:
    """A subclass of uvicorn's protocol (httptools or h11) that closes a connection whose request headers take over
    `timeout_s`, or answers 431 and closes one whose headers pass `max_header_bytes` (row 38: 100 MB of headers
    were read whole); a chunked body's trailer fields count against the same cap (row 35: httptools kept every
    one in the request's header list; h11 refuses more than 16 KiB of them itself). A body left unread after its
    answer (a 413 or 429 from the Guard) is drained for at most `timeout_s` and DRAIN_BYTES, then the connection is
    closed. A response the client does not read (the send buffer full) for `send_timeout_s` closes it too (row
    34), and each request's scope carries CLOSE_KEY, with which the Guard closes a connection it displaces."""
    parser_hooks = hasattr(base, "on_headers_complete")  # httptools says where headers begin and end; h11 does not

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _write_deadline: asyncio.TimerHandle | None = None
        _in_headers = False
        _header_bytes = 0
        _discarding = False
        _in_body = False  # httptools: between a message's headers and its end (trailers come in here)
        _framing = 0  # bytes of the body part that are not body: chunk sizes, extensions, trailer fields
        _chunks = 0
        _body_seen = 0
        _drained: int | None = None  # bytes read and dropped since an early answer (None: not draining)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._begin()

        def on_message_begin(self) -> None:  # httptools only
            super().on_message_begin()
            self.scope[CLOSE_KEY] = self._close_now
            self._begin()

        def on_headers_complete(self) -> None:  # httptools only
            self._end()
            self._in_body, self._framing, self._chunks = True, 0, 0
            super().on_headers_complete()

        def on_header(self, name: bytes, value: bytes) -> None:  # httptools only
            if not self._in_body:
                super().on_header(name, value)  # a trailer field is dropped: nothing here reads one

        def on_chunk_header(self) -> None:  # httptools only
            self._chunks += 1

        def on_body(self, body: bytes) -> None:  # httptools only
            self._body_seen += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:  # httptools only
            self._in_body = False
            super().on_message_complete()

        def handle_events(self) -> None:  # h11 only
            before = self.cycle
            super().handle_events()
            if self.cycle is not before and self.cycle is not None:
                self.cycle.scope[CLOSE_KEY] = self._close_now

        def send_400_response(self, msg: str) -> None:  # h11 only: its own refusal (16 KiB of trailers among them)
            cycle = self.cycle
            if cycle is not None and cycle.response_started:
                self._close_now()  # an answer already begun cannot be followed by a 400 (h11 raised)
                return
            if cycle is not None:  # its app sees the client leave; what it sends is dropped
                cycle.disconnected = True
                cycle.message_event.set()
            super().send_400_response(msg)

        def data_received(self, data: bytes) -> None:
            if self._discarding or self._drained is not None:
                self._drop(len(data))
                if self._discarding:
                    return  # after a 431: read and dropped until the close, so the close resets nothing unread
            if not parser_hooks and self.conn.their_state is not _h11_send_body():
                self._begin()  # h11: bytes before a request's body are its headers
            if self._in_headers:  # counted before the parser sees them (h11 would answer its own 400 at 16 KiB)
                end = data.find(b"\r\n\r\n")
                if self._header_bytes + (len(data) if end < 0 else end) > max_header_bytes:
                    self._too_large()
                    return
            before, in_body, body_before = self.cycle, self._in_body, self._body_seen
            super().data_received(data)
            if not parser_hooks and self.cycle is not before:
                self._end()
            if self._in_headers:
                self._header_bytes += len(data)
            if in_body and self._in_body:  # still in this message's body: what was not body is framing
                self._framing += len(data) - (self._body_seen - body_before)
                if self._framing > max_header_bytes + CHUNK_FRAMING * self._chunks:
                    self._too_large()

        def on_response_complete(self) -> None:
            before = self.cycle
            super().on_response_complete()
            if self.cycle is not before:
                self._end()  # h11: a pipelined request's headers were read
            elif before is not None and before.more_body and self._deadline is None:
                self._deadline = self.loop.call_later(timeout_s, self._too_slow)  # draining an unread body
                self._drained = 0

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_deadline is None:
                self._write_deadline = self.loop.call_later(send_timeout_s, self._unread)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None
            super().connection_lost(exc)

        def _begin(self) -> None:
            self._drained = None
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

        def _drop(self, size: int) -> None:
            self._drained = (self._drained or 0) + size
            if self._drained > DRAIN_BYTES:
                self._close_now()

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def _unread(self) -> None:
            self._write_deadline = None
            log.info("an answer was not read for %g s: its connection is closed", send_timeout_s)
            self._close_now()

        def _close_now(self) -> None:
            """Closed at once, unsent bytes dropped (a client that reads nothing would hold a graceful close)."""
            self.transport.abort()

        def _too_large(self) -> None:
            """431, then our side shut (the client reads the answer and the end), the rest dropped until the
            deadline or DRAIN_BYTES closes: closing with the client's bytes unread would reset the connection
            before it read. An answer already begun (trailers after it) cannot be followed by one: closed."""
            self._end()
            self._in_body = False
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and cycle.response_started:
                self._close_now()
                return
            if cycle is not None:  # its app sees the client leave; what it sends is dropped
                cycle.disconnected = True
                cycle.message_event.set()
            self._discarding, self._drained = True, 0
            self.transport.write(TOO_LARGE)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._deadline = self.loop.call_later(timeout_s, self._too_slow)

    HeaderDeadline.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline


#: The bytes an early answer's unread body (or a refused request's rest) is drained for before the close: a
#: client still sending reads the answer first (an early close resets it), and no more is read than this.
DRAIN_BYTES = 16 << 20
#: What one chunk's framing may take beside the headers' cap (its size line, an extension, the CRLFs).
CHUNK_FRAMING = 64

TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def _h11_send_body() -> Any:
    import h11

    return h11.SEND_BODY
