"""The server's door: what every connection meets before Gradio or the OpenAI API see a request.

- Uploads (`POST /gradio_api/upload`, the page's and gradio_client's way to send a file) are limited in bytes per
  client address per minute (`upload_mb_per_minute`, 429) and for all addresses together per hour
  (`upload_total_mb`, 507: Gradio keeps an upload up to an hour, so this bounds the disk they take). An upload
  must declare its size (Content-Length; 411 otherwise): it is charged before a byte is read, and given back
  when Gradio refuses it. Each file part costs a filesystem block (4 KiB) and an inode however small, so each
  part is charged a block more as its bytes arrive, and an upload of more than MAX_UPLOAD_FILES parts (what the
  page and the clients send at most) is a 413 before the app sees the next part. The address is uvicorn's
  (X-Forwarded-For only from FORWARDED_ALLOW_IPS), as for the page's image limit (web/access.py).
- Every other way bytes reach the disk through Gradio counts against the same budgets, before a byte is kept
  (issue 45): a multipart POST to any Gradio route (`/gradio_api/process_recording`, any route a Gradio
  upgrade adds) is charged as an upload; an MCP request that carries a `data:` URL (the `edit` tool's images,
  which Gradio writes to its temp folder before the tool runs) is charged to its caller's address by the length
  of those strings and a block each (at most MAX_UPLOAD_FILES of them), found in the parsed message
  (`data_urls`: a JSON escape such as `\\u0064ata:` is the same string to Gradio, issue 52).
  The MCP loopback client's own re-upload of those files (it carries this process's secret) is not charged again.
- An address may take at most a quarter of the hourly total (or its per-minute amount, if larger): one address
  cannot keep every other address's uploads refused.
- Bodies are capped per route while they arrive: a Gradio POST that is not an upload at `request_body_mb`
  (JSON: a prompt and file references), an MCP request at MCP_BODY_LIMIT (the MCP SDK's own 4 MiB); beyond it
  a 413, before the app reads the body (a declared length) or as soon as it passes the cap (a streamed one).
- A full Gradio queue answers 503 from `/gradio_api/queue/join` and `/gradio_api/call/...` with no `Retry-After`: the
  door adds one.
- No server path in an answer: Gradio names every file by its absolute path (`path`, and its
  `/gradio_api/file=<path>` URL). The door answers with aliases instead, `/@outputs/...` for `outputs_dir` and
  `/@uploads/...` for Gradio's upload folder, `/@cache` for `cache_dir` (the page's status names it), and reads
  them back in what clients send (a JSON body, a file URL),
  so the page's "use as reference" and gradio_client's files keep working.
- Connections (a header deadline, requests in progress in all and per address) are web/guard.py's; every body's
  deadline, cap and bytes in flight, on every route, are web/bodies.py's (this door's caps come after them).

A pure ASGI middleware (`app_kwargs={"middleware": [...]}` reaches Gradio's FastAPI app): bodies stream through.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from neuron_app.errors import RateLimited, RequestError
from neuron_app.settings import Settings
from neuron_app.web.access import MCP_SECRET, MCP_SECRET_HEADER, MINUTE_S, Limit, Limiter

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

HOUR_S = 3600.0
MB = 1 << 20
UPLOAD_PATHS = ("/gradio_api/upload", "/upload")
QUEUE_JOIN = "/gradio_api/queue/join"
GRADIO_CALL = "/gradio_api/call/"  # gradio_client's and curl's way in: a full queue is a 503 here too
GRADIO_API = "/gradio_api/"
FILE_ROUTE = "/gradio_api/file="
#: The app's own routes (web/openai/routes.py, web/ops.py): their answers carry no server folder.
OWN_ROUTES = ("/v1/", "/healthz", "/readyz", "/metrics")
#: The MCP SDK's own limit of a message: an MCP request larger than this is refused at the door.
MCP_BODY_LIMIT = 4 << 20
MCP_PATH = "/gradio_api/mcp"
#: The share of `upload_total_mb` one address may take in an hour (or its per-minute amount, if larger).
ADDRESS_SHARE = 0.25
#: What a full queue tells a client to wait (a generation takes seconds to a minute).
QUEUE_RETRY_AFTER_S = 5
#: What one uploaded file costs the disk at least besides its bytes: a filesystem block (and an inode).
FILE_BLOCK = 4096
#: File parts one upload may carry: what the page and the clients send at most (the OpenAI edit form's 16 images
#: and a mask; the page sends a request's references together, gradio_client one file per upload).
MAX_UPLOAD_FILES = 17
#: An upload's first bytes are held until counted (999 one-byte files take 135 KB): Gradio writes none of them.
PARTS_WINDOW = 256 << 10


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
        self.aliases = Aliases.for_settings(settings)
        self.limiter = limiter or Limiter()
        per_minute, total = int(settings.upload_mb_per_minute * MB), int(settings.upload_total_mb * MB)
        share = min(total, max(per_minute, int(total * ADDRESS_SHARE)))
        self.per_address = [
            Limit(per_minute, MINUTE_S, "per minute", "upload_bytes_per_minute", "bytes"),
            Limit(share, HOUR_S, "per hour", "upload_bytes_per_hour_address", "bytes"),
        ]
        self.total = [Limit(total, HOUR_S, "per hour", "upload_bytes_per_hour", "bytes")]
        self.body_limit = int(settings.request_body_mb * MB)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path.startswith(FILE_ROUTE):  # a file by its alias: the real path, its bytes as they are, a refusal aliased
            real = self.aliases.inbound(path.encode()).decode()
            send = self.aliases.outbound_send(send, refusals_only=True)  # Gradio's 403 names the folder (row 27)
            await self.app({**scope, "path": real, "raw_path": real.encode()}, receive, send)
            return
        if not path.startswith(OWN_ROUTES):  # ours name no folder; their base64 images are left as they are
            send = self.aliases.outbound_send(send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        post = scope.get("method") == "POST"
        if post and path.startswith(MCP_PATH):
            await self.mcp(scope, receive, send, headers)
            return
        multipart = headers.get("content-type", "").lower().startswith("multipart/")
        if post and (path.rstrip("/") in UPLOAD_PATHS or (path.startswith(GRADIO_API) and multipart)):
            await self.upload(scope, receive, send)
            return
        if post and path.startswith(GRADIO_API):
            body = await read_capped(receive, headers, self.body_limit)
            if body is None:
                await _answer(send, 413, f"the request body is larger than {self.body_limit} bytes")
                return
            scope, receive = self.aliases.with_body(scope, receive, body)
        if path.startswith(QUEUE_JOIN) or path.startswith(GRADIO_CALL):
            send = _retry_after_on_503(send)
        await self.app(scope, receive, send)

    async def mcp(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> None:
        """An MCP message: capped at MCP_BODY_LIMIT; one with a `data:` URL charged as an upload by its size."""
        body = await read_capped(receive, headers, MCP_BODY_LIMIT)
        if body is None:
            await _answer(send, 413, f"an MCP request may be at most {MCP_BODY_LIMIT} bytes")
            return
        if isinstance(body, bytes) and _too_deep(body):  # the MCP SDK's parser answered a deep one with a 500
            await _answer(send, 400, "the request body is nested too deeply")
            return
        refusal = progress_token_refusal(body) if isinstance(body, bytes) else None
        if refusal is not None:
            await _answer_rpc(send, refusal, body)
            return
        files, chars = data_urls(body) if isinstance(body, bytes) else (0, 0)
        if files > MAX_UPLOAD_FILES:  # each becomes a file of its own: capped as an upload's parts are
            await _answer(send, 413, f"an MCP request may carry at most {MAX_UPLOAD_FILES} data: URLs")
            return
        if files and await self.charge(scope, chars + files * FILE_BLOCK, send) is None:  # a block each at least
            return
        scope, receive = self.aliases.with_body(scope, receive, body)
        await self.app(scope, receive, send)

    async def charge(self, scope: Scope, size: int, send: Send) -> list[Callable[[], None]] | None:
        """Take `size` bytes from the caller's and the total upload budget, or answer the refusal and return None.
        The MCP loopback client's uploads (this process's secret) were charged to the MCP caller already."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        token = headers.get(MCP_SECRET_HEADER, "")
        if token and hmac.compare_digest(token.encode("utf-8", "surrogatepass"), MCP_SECRET.encode()):
            return []
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
            return None
        return refunds

    async def upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Charged by its declared length, then by a block more for each part as its bytes arrive (a one-byte file
        takes a 4 KiB block and an inode, kept an hour: red team turn 7, row 47); past MAX_UPLOAD_FILES parts a
        413 before the app sees the next part's bytes, and none at all within the first PARTS_WINDOW bytes."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        declared = headers.get("content-length", "")
        if not declared.isdigit():
            await _answer(send, 411, "an upload must declare its size (Content-Length)")
            return
        refunds = await self.charge(scope, int(declared), send)
        if refunds is None:
            return
        status: list[int] = []
        parts = PartCounter(headers.get("content-type", ""))
        answered = [False]  # the door refused it mid-body: the app's own answer is dropped
        window: list[bytes] | None = []  # the body's first PARTS_WINDOW bytes: counted before the app sees them

        async def counted() -> MutableMapping[str, Any]:
            nonlocal window
            while not answered[0]:
                message = await receive()
                if message["type"] != "http.request":
                    return message
                body, more = message.get("body", b""), message.get("more_body", False)
                new = parts.feed(body)  # parts known to be whole: the closing delimiter opens none
                if parts.files > MAX_UPLOAD_FILES:
                    answered[0] = True
                    log.info("upload refused: more than %d files", MAX_UPLOAD_FILES)
                    await _answer(send, 413, f"an upload may carry at most {MAX_UPLOAD_FILES} files")
                    break
                if new:
                    charged = await self.charge(scope, new * FILE_BLOCK, send)  # answers a refusal itself
                    if charged is None:
                        answered[0] = True
                        break
                    refunds.extend(charged)
                if window is None:
                    return message
                window.append(body)
                if more and parts.size < PARTS_WINDOW:
                    continue
                body, window = b"".join(window), None
                return {"type": "http.request", "body": body, "more_body": more}
            return {"type": "http.disconnect"}

        async def watch(message: MutableMapping[str, Any]) -> None:
            if answered[0]:
                return
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, counted, watch)
        except Exception:
            if not answered[0]:  # the app's own failure; one the door's disconnect caused is answered already
                raise
        finally:
            if not answered[0] and (not status or status[0] >= 400):  # refused by Gradio or cut off: not kept
                for refund in refunds:  # (refused by the door mid-body: the parts before may be on disk, kept)
                    refund()


class PartCounter:
    """The parts of a multipart body as it streams: its boundary's delimiters, found across chunk edges. A body
    that names no boundary has no parts here (Gradio refuses it)."""

    def __init__(self, content_type: str) -> None:
        match = re.search(r'boundary="?([^";]+)"?', content_type, re.IGNORECASE)
        self.delimiter = b"--" + match.group(1).encode("latin-1") if match else b""
        self.tail = b""
        self.delimiters = 0
        self.size = 0

    @property
    def files(self) -> int:
        """Parts begun for certain: every delimiter but the last may open one; the last may be the closing one."""
        return max(0, self.delimiters - 1)

    def feed(self, chunk: bytes) -> int:
        """How many more parts `chunk` shows begun for certain (a delimiter split across two chunks is counted once)."""
        self.size += len(chunk)
        if not self.delimiter or not chunk:
            return 0
        data, before = self.tail + chunk, self.files
        self.delimiters += data.count(self.delimiter)
        self.tail = data[-(len(self.delimiter) - 1) :]  # shorter than a delimiter: none is counted twice
        return self.files - before


def _upload_folder() -> str:
    """Where Gradio keeps uploads (gradio.utils.get_upload_folder, without importing gradio here)."""
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
        folders = {str(settings.outputs_dir): "/@outputs", _upload_folder(): "/@uploads"}
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
            return scope, _replay([body], receive)
        body = self.inbound(body)
        raw = [
            (k, v) for k, v in scope.get("headers", []) if k.lower() not in (b"content-length", b"transfer-encoding")
        ]
        raw.append((b"content-length", str(len(body)).encode()))
        return {**scope, "headers": raw}, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


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


#: Brackets beyond which a JSON body is parsed once here to see whether Python's parser can take its depth.
DEEP_BRACKETS = 900


def _too_deep(body: bytes) -> bool:
    """A JSON body nested beyond what Python's parser takes (it raises RecursionError); counted first, so an
    ordinary message is never parsed twice."""
    if body.count(b"[") + body.count(b"{") < DEEP_BRACKETS:
        return False
    try:
        json.loads(body)
    except RecursionError:
        return True
    except ValueError:
        return False  # not JSON at all: the MCP server says so itself
    return False


def data_urls(body: bytes) -> tuple[int, int]:
    """How many strings of a JSON message Gradio will write to a file (those that start with `data:`) and their
    characters, decided on the parsed message: `\\u0064ata:` or any other JSON spelling is the same string (row 6).
    Without `data:` or a `\\u` escape in its bytes, a message holds none, and is not parsed."""
    if b"data:" not in body.lower() and b"\\u" not in body:
        return 0, 0
    try:
        stack = [json.loads(body)]
    except (ValueError, RecursionError):
        return 0, 0  # not JSON (the MCP server says so itself), or too deep (refused before this)
    files = chars = 0
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and node[:5].lower() == "data:":
            files, chars = files + 1, chars + len(node)
    return files, chars


#: The longest `_meta.progressToken` an MCP request may carry: each progress notification echoes it (row 29).
MAX_PROGRESS_TOKEN_CHARS = 256


def progress_token_refusal(body: bytes) -> str | None:
    """Why the message's `params._meta.progressToken` is refused (not a string of at most
    MAX_PROGRESS_TOKEN_CHARS characters, nor an integer), or None. Parsed only when its name may be in it."""
    if b"progresstoken" not in body.lower() and b"\\u" not in body:
        return None
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: the MCP server says so itself
    for one in message if isinstance(message, list) else [message]:
        params = one.get("params") if isinstance(one, dict) else None
        meta = params.get("_meta") if isinstance(params, dict) else None
        if not isinstance(meta, dict) or "progressToken" not in meta:
            continue
        token = meta["progressToken"]
        if isinstance(token, bool) or not isinstance(token, str | int):
            return "_meta.progressToken must be a string or an integer"
        if isinstance(token, str) and len(token) > MAX_PROGRESS_TOKEN_CHARS:
            return f"_meta.progressToken may be at most {MAX_PROGRESS_TOKEN_CHARS} characters"
    return None


async def _answer_rpc(send: Send, message: str, body: bytes) -> None:
    """A 400 in JSON-RPC's shape (invalid params, -32602), with the request's id where it has one."""
    try:
        request = json.loads(body)
    except ValueError:
        request = None
    ident = request.get("id") if isinstance(request, dict) else None
    answer = json.dumps({"jsonrpc": "2.0", "id": ident, "error": {"code": -32602, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def _replay(messages: list[MutableMapping[str, Any]], then: Receive) -> Receive:
    """`messages` first, then the connection's own (a streaming answer waits there for the disconnect)."""
    pending = list(messages)

    async def receive() -> MutableMapping[str, Any]:
        return pending.pop(0) if pending else await then()

    return receive


def _retry_after_on_503(send: Send) -> Send:
    async def wrapped(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] == 503:
            headers = list(message.get("headers", []))
            if not any(name.lower() == b"retry-after" for name, _ in headers):
                headers.append((b"retry-after", str(QUEUE_RETRY_AFTER_S).encode()))
            message = {**message, "headers": headers}
        await send(message)

    return wrapped
