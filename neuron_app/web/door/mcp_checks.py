"""What the door parses an MCP message for: its depth, its `data:` URLs, its progress token."""

from __future__ import annotations

import json

from neuron_app.web.door.aliases import Send

#: Brackets beyond which a JSON body is parsed once here to see whether Python's parser can take its depth.
DEEP_BRACKETS = 900


def too_deep(body: bytes) -> bool:
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


async def answer_rpc(send: Send, message: str, body: bytes) -> None:
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
