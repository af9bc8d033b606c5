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
Its helpers: door/aliases.py (server folders <-> aliases, a body read whole), door/mcp_checks.py (what an MCP
message is parsed for).
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Callable, MutableMapping
from typing import Any

from neuron_app.errors import RateLimited, RequestError
from neuron_app.settings import Settings
from neuron_app.web.access import MCP_SECRET, MCP_SECRET_HEADER, MINUTE_S, Limit, Limiter
from neuron_app.web.door.aliases import Aliases, Receive, Scope, Send, answer, read_capped
from neuron_app.web.door.mcp_checks import answer_rpc, data_urls, progress_token_refusal, too_deep

log = logging.getLogger(__name__)

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
                await answer(send, 413, f"the request body is larger than {self.body_limit} bytes")
                return
            scope, receive = self.aliases.with_body(scope, receive, body)
        if path.startswith(QUEUE_JOIN) or path.startswith(GRADIO_CALL):
            send = _retry_after_on_503(send)
        await self.app(scope, receive, send)

    async def mcp(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> None:
        """An MCP message: capped at MCP_BODY_LIMIT; one with a `data:` URL charged as an upload by its size."""
        body = await read_capped(receive, headers, MCP_BODY_LIMIT)
        if body is None:
            await answer(send, 413, f"an MCP request may be at most {MCP_BODY_LIMIT} bytes")
            return
        if isinstance(body, bytes) and too_deep(body):  # the MCP SDK's parser answered a deep one with a 500
            await answer(send, 400, "the request body is nested too deeply")
            return
        refusal = progress_token_refusal(body) if isinstance(body, bytes) else None
        if refusal is not None:
            await answer_rpc(send, refusal, body)
            return
        files, chars = data_urls(body) if isinstance(body, bytes) else (0, 0)
        if files > MAX_UPLOAD_FILES:  # each becomes a file of its own: capped as an upload's parts are
            await answer(send, 413, f"an MCP request may carry at most {MAX_UPLOAD_FILES} data: URLs")
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
                await answer(send, 413, str(exc))
            else:
                status = 429 if not refunds else 507
                await answer(send, status, str(exc), {"Retry-After": str(max(1, round(exc.retry_after_s)))})
            return None
        return refunds

    async def upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Charged by its declared length, then by a block more for each part as its bytes arrive (a one-byte file
        takes a 4 KiB block and an inode, kept an hour: red team turn 7, row 47); past MAX_UPLOAD_FILES parts a
        413 before the app sees the next part's bytes, and none at all within the first PARTS_WINDOW bytes."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        declared = headers.get("content-length", "")
        if not declared.isdigit():
            await answer(send, 411, "an upload must declare its size (Content-Length)")
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
                    await answer(send, 413, f"an upload may carry at most {MAX_UPLOAD_FILES} files")
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


def _retry_after_on_503(send: Send) -> Send:
    async def wrapped(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] == 503:
            headers = list(message.get("headers", []))
            if not any(name.lower() == b"retry-after" for name, _ in headers):
                headers.append((b"retry-after", str(QUEUE_RETRY_AFTER_S).encode()))
            message = {**message, "headers": headers}
        await send(message)

    return wrapped
