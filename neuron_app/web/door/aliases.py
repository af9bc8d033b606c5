"""Server folders <-> the aliases the door shows, and a body read whole for the app (web/door/middleware.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from neuron_app.settings import Settings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


async def answer(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": message, "error": message}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def upload_folder() -> str:
    """Where Gradio keeps uploads (gradio.utils.getupload_folder, without importing gradio here)."""
    import os
    import tempfile
    from pathlib import Path

    return os.environ.get("GRADIO_TEMP_DIR") or str((Path(tempfile.gettempdir()) / "gradio").resolve())


class Aliases:
    """Server folders <-> the aliases answers show (see the module docstring)."""

    def __init__(self, folders: dict[str, str]) -> None:
        # The longest folder first (outputs_dir lies inside cache_dir); a folder only as a whole path segment.
        pairs = sorted(((real.rstrip("/"), alias) for real, alias in folders.items()), key=lambda p: -len(p[0]))
        self.out = [(re.compile(re.escape(real.encode()) + rb"(?![\w.-])"), alias.encode()) for real, alias in pairs]
        self.back = [(alias.encode(), real.encode()) for real, alias in pairs]

    @classmethod
    def for_settings(cls, settings: Settings) -> Aliases:
        folders = {str(settings.outputs_dir): "/@outputs", upload_folder(): "/@uploads"}
        return cls(folders | {str(settings.cache_dir): "/@cache"})

    def local_path(self, path: str) -> str:
        """The server's path of an aliased one (what the MCP mend reads the PNG from); others as they are."""
        for alias, real in self.back:
            if path.startswith(alias.decode() + "/"):
                return real.decode() + path[len(alias) :]
        return path

    def public_path(self, path: str) -> str | None:
        """The alias of a server path inside an aliased folder (what the MCP mend links to), or None."""
        aliased = self.outbound(path.encode()).decode()
        return aliased if aliased != path and aliased.startswith("/@") else None

    def outbound(self, data: bytes) -> bytes:
        for pattern, alias in self.out:
            data = pattern.sub(alias, data)
        return data

    def inbound(self, data: bytes) -> bytes:
        """Aliases back to folders, only where a path starts: a JSON string's first character, or after `file=`."""
        for alias, real in self.back:
            for lead in (b'"', b"file="):
                data = data.replace(lead + alias + b"/", lead + real + b"/")
        return data

    def outbound_send(self, send: Send, *, refusals_only: bool = False) -> Send:
        """Rewrite text answers (JSON, server-sent events, HTML); their length changes, so it is not declared.
        `refusals_only`: only answers of status 400 and above (a file's own bytes are left as they are)."""
        rewrite = [False]

        async def wrapped(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                kind = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                rewrite[0] = any(t in kind for t in (b"json", b"event-stream", b"text/html", b"text/plain"))
                rewrite[0] = rewrite[0] and (message.get("status", 200) >= 400 or not refusals_only)
                if rewrite[0]:
                    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
                    message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and rewrite[0] and message.get("body"):
                message = {**message, "body": self.outbound(message["body"])}
            await send(message)

        return wrapped

    def with_body(
        self, scope: Scope, receive: Receive, body: bytes | MutableMapping[str, Any]
    ) -> tuple[Scope, Receive]:
        """A body read whole (`read_capped`), given to the app with the real folders; a disconnect as it came."""
        if not isinstance(body, bytes):
            return scope, replay([body], receive)
        body = self.inbound(body)
        raw = [
            (k, v) for k, v in scope.get("headers", []) if k.lower() not in (b"content-length", b"transfer-encoding")
        ]
        raw.append((b"content-length", str(len(body)).encode()))
        return {**scope, "headers": raw}, replay([{"type": "http.request", "body": body, "more_body": False}], receive)


async def read_capped(receive: Receive, headers: dict[str, str], cap: int) -> bytes | Message | None:
    """The whole body, or None once it is known to pass `cap`: from its declared length before a byte is read,
    or as it streams. A disconnect is returned as its message, for the app to see."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        return None
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return message
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def replay(messages: list[MutableMapping[str, Any]], then: Receive) -> Receive:
    """`messages` first, then the connection's own (a streaming answer waits there for the disconnect)."""
    pending = list(messages)

    async def receive() -> MutableMapping[str, Any]:
        return pending.pop(0) if pending else await then()

    return receive
