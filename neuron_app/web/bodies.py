"""One policy for request bodies, wherever they arrive (issue 52: red-team turn 6, rows 3, 7 and 12).

The rules used to be written per route (the door's Gradio caps, the OpenAI routes' own), and a route Gradio adds
outside them (`POST /login` spooled a 2 GiB multipart file) had none, and no route had a deadline for its body.
Here, for every request the server answers (web/guard.py wraps them all), as the bytes arrive and before the app
reads, parses or spools them:

- the route's cap (`BodyRules`): a declared length beyond it is a 413 before a byte is read, a streamed body a 413
  once it passes it; a route the table does not know gets the smallest cap, `SMALLEST_BODY`;
- the deadline for the whole body (`body_timeout_s` from the headers' end): a 408, and the connection closed;
- the bytes of bodies one address has in flight (`address_body_mb`, held until each request ends): a 429.

A cut request's app sees the client leave (`http.disconnect`); the answer is the Guard's. A 408 closes the
connection; after a 413 or 429 the rest of the body is read and dropped for at most `header_timeout_s` (closing
at once would reset a client still sending, before it reads the answer), then the connection is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from neuron_app.settings import Settings

log = logging.getLogger(__name__)


class Ledger(Protocol):
    """What a body's watch charges and reads: the Guard's per-address bytes and the bodies still arriving (the
    Guard wraps every route and imports this module, so this one names only what it needs)."""

    body_bytes: Counter[str]  # a missing address reads 0
    arriving: dict[int, Any]
    address_body_cap: int
    body_timeout_s: float

    def to_stream(self, watch: Watch) -> None:
        """A response that turned out long-lived (server-sent events): counted as a stream from now on."""


#: Where web/guard.py's connection protocol puts a callable that closes the request's connection at once (an
#: answer the Guard ends for its place: a stream displaced at its cap, an unread response at the request cap).
CLOSE_KEY = "neuron_app.close_connection"
#: A long-lived answer: every server-sent event stream (heartbeat, queue data, MCP, `stream=true`).
EVENT_STREAM = b"text/event-stream"


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MB = 1 << 20
#: The cap of a route the table does not know (and of `/login`: a user name and a password).
SMALLEST_BODY = 64 << 10
#: The OpenAI routes' own caps (web/openai/forms.py EDIT_BODY_LIMIT, routes.py GENERATION_BODY_LIMIT; web may not
#: import its rooms, so tests/web/test_bodies.py checks they agree).
EDIT_BODY_LIMIT, GENERATION_BODY_LIMIT = 50 << 20, 1 << 20
DISCONNECT = {"type": "http.disconnect"}
#: Answers in OpenAI's error shape (the SDK reads `error.message`); elsewhere Gradio's `detail`.
OPENAI_PREFIX = "/v1/"
CODES = {408: "request_timeout", 413: "request_too_large", 429: "rate_limit_exceeded", 503: "overloaded"}


@dataclass(frozen=True)
class Rule:
    """A route (a path, or a prefix ending in `/`), its body cap in bytes, and the budget its bytes are charged to."""

    path: str
    cap: int
    budget: str
    multipart_cap: int | None = None  # a multipart body here is an upload (Gradio's routes): its own cap

    def matches(self, path: str) -> bool:
        return path.rstrip("/") == self.path.rstrip("/") or (self.path.endswith("/") and path.startswith(self.path))


class BodyRules:
    """The door's table: the first rule that matches a path; the smallest cap for any other."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules

    @classmethod
    def for_settings(cls, settings: Settings) -> BodyRules:
        from neuron_app.web.door.middleware import MCP_BODY_LIMIT, MCP_PATH, UPLOAD_PATHS

        upload = int(settings.upload_mb_per_minute * MB)  # the most one address may upload in a minute
        gradio = int(settings.request_body_mb * MB)
        uploads = [Rule(path, upload, "uploads (per address, all addresses)") for path in UPLOAD_PATHS]
        return cls(
            [
                *uploads,
                Rule(MCP_PATH + "/", MCP_BODY_LIMIT, "uploads, for the `data:` strings the message carries"),
                Rule("/gradio_api/", gradio, "-; a multipart body: uploads", multipart_cap=upload),
                Rule("/v1/images/edits", EDIT_BODY_LIMIT, "the key's or address's images (checked first)"),
                Rule("/v1/images/generations", GENERATION_BODY_LIMIT, "the key's or address's images"),
                Rule("/login", SMALLEST_BODY, "-"),
            ]
        )

    def rule(self, path: str) -> Rule | None:
        return next((rule for rule in self.rules if rule.matches(path)), None)

    def cap(self, path: str, scope: Scope) -> int:
        rule = self.rule(path)
        if rule is None:
            return SMALLEST_BODY
        if rule.multipart_cap is not None and header(scope, b"content-type").lower().startswith("multipart/"):
            return rule.multipart_cap
        return rule.cap


def header(scope: Scope, name: bytes) -> str:
    return next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == name), "")


def declared_length(scope: Scope) -> int | None:
    value = header(scope, b"content-length").strip()
    return int(value) if value.isdigit() else None


def has_body(scope: Scope) -> bool:
    return bool(declared_length(scope)) or bool(header(scope, b"transfer-encoding"))


async def answer(
    send: Send, path: str, status: int, message: str, *, close: bool = False, retry_after: int | None = None
) -> None:
    """The Guard's own answer: OpenAI's error shape under /v1/, else Gradio's; `close` ends the connection after it
    (a body left unread must not be taken for the next request)."""
    if path.startswith(OPENAI_PREFIX):
        kind = "rate_limit_error" if status == 429 else "invalid_request_error"
        error = {"message": message, "type": kind, "param": None, "code": CODES.get(status)}
        body = json.dumps({"error": error}).encode()
    else:
        body = json.dumps({"detail": message, "error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Watch:
    """One request's body: its cap, its deadline and its address's bytes in flight, checked as each chunk arrives."""

    def __init__(
        self, guard: Ledger, scope: Scope, receive: Receive, send: Send, cap: int, address: str, deadline: float
    ):
        self.guard, self.path, self.inner, self.raw_send = guard, scope.get("path", ""), receive, send
        self.cap, self.address, self.deadline = cap, address, deadline
        self.received, self.charged = 0, declared_length(scope) or 0
        guard.body_bytes[address] += self.charged
        self.done = not has_body(scope)
        self.blocked = False  # waiting for the client's next bytes: what the Guard may cut at its cap
        self.writing = False  # waiting for the client to read what was sent: the same
        self.write_since = 0.0  # when the send it waits in began
        self.sent = 0  # bytes of the response handed to the connection
        self.cut = False
        self.started = False
        self.stream = False  # counted as a long-lived answer (the Guard's streams), not a request in progress
        self.counted = True  # holds its place until the Guard lets it go (once)
        self.close_connection: Callable[[], None] | None = scope.get(CLOSE_KEY)
        loop = asyncio.get_running_loop()
        self.began = loop.time()
        self.wake: asyncio.Future[None] = loop.create_future()
        if not self.done:
            guard.arriving[id(self)] = self

    async def receive(self) -> MutableMapping[str, Any]:
        if self.cut:
            return DISCONNECT
        if self.done:  # the app waits here for the client to leave (a stream), or for the Guard to end it
            if self.wake.done():
                return DISCONNECT
            if self.close_connection is not None:
                return await self.inner()  # the Guard ends it by closing the connection: the client left
            inner = asyncio.ensure_future(self.inner())
            try:
                await asyncio.wait((inner, self.wake), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not inner.done():
                    inner.cancel()  # also when this wait was cancelled (Starlette's is_disconnected)
            return inner.result() if inner.done() and not inner.cancelled() else DISCONNECT
        self.blocked = True
        try:
            message = await self.next_message()
        finally:
            self.blocked = False
        if message is None:
            return DISCONNECT
        if message["type"] != "http.request":
            self.finish()
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.cap:
            return await self.cut_off(413, f"the request body is larger than {self.cap} bytes")
        if self.received > self.charged:
            self.guard.body_bytes[self.address] += self.received - self.charged
            self.charged = self.received
            if self.guard.body_bytes[self.address] > self.guard.address_body_cap:
                held = self.guard.body_bytes[self.address]
                return await self.cut_off(429, f"address {self.address} has {held} bytes of request bodies in flight")
        if not message.get("more_body", False):
            self.finish()
        return message

    async def next_message(self) -> MutableMapping[str, Any] | None:
        """The client's next message, or None once this request was cut (its deadline passed, or evicted)."""
        remaining = self.deadline - asyncio.get_running_loop().time()
        if not self.wake.done() and remaining > 0:
            inner = asyncio.ensure_future(self.inner())
            await asyncio.wait((inner, self.wake), timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if inner.done() and not self.wake.done():
                return inner.result()
            inner.cancel()
        if self.wake.done():
            rate = self.rate(asyncio.get_running_loop().time())
            message = f"the request was displaced at the server's request cap: its body came at {rate:.0f} bytes/s"
        else:
            message = f"the request body did not arrive within {self.guard.body_timeout_s:g} s"
        await self.cut_off(408, message)
        return None

    def rate(self, now: float, grace_s: float = 0.0) -> float:
        """Bytes per second so far, of its body while it arrives, else of its answer (over at least `grace_s`)."""
        moved = self.received if not self.done else self.sent
        return moved / max(now - self.began, grace_s, 1e-3)

    async def cut_off(self, status: int, message: str) -> MutableMapping[str, Any]:
        """Answer for the app (if it has not answered), close the connection, and tell the app the client left."""
        self.cut = True
        self.finish()
        log.info("request body cut (%d): %s %s", status, self.path, message)
        if not self.started:
            self.started = True
            retry = 2 if status == 429 else None  # a 408's client sends nothing more: its connection is closed
            await answer(self.raw_send, self.path, status, message, close=status == 408, retry_after=retry)
        return DISCONNECT

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if self.cut:
            if self.wake.done():
                raise OSError("the server ended this answer for its place")  # Starlette: the client left
            return  # the Guard answered for this request
        if message["type"] == "http.response.start":
            self.started = True
            kind = next((v for k, v in message.get("headers", []) if k.lower() == b"content-type"), b"")
            if EVENT_STREAM in kind.lower() and not self.stream:
                self.guard.to_stream(self)
        self.writing, self.write_since = True, asyncio.get_running_loop().time()
        try:
            await self.raw_send(message)
        finally:
            self.writing = False
        self.sent += len(message.get("body", b""))

    def evict(self) -> None:
        """Displaced at the Guard's cap: a body still arriving gets its 408; an answer has its connection closed
        (the app sees the client leave)."""
        if not self.wake.done():
            self.wake.set_result(None)
        if self.done:
            self.cut = True
            if self.close_connection is not None:
                self.close_connection()

    def finish(self) -> None:
        self.done = True
        self.guard.arriving.pop(id(self), None)

    def close(self) -> None:
        """The request ended: its body's bytes are no longer in flight."""
        self.finish()
        self.guard.body_bytes[self.address] -= self.charged
        if self.guard.body_bytes[self.address] <= 0:
            del self.guard.body_bytes[self.address]
