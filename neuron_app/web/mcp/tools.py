"""Gradio's MCP server (`launch(mcp_server=True)`): our named endpoints `generate`, `edit` and `status` become tools.

Gradio 6.31 builds each tool from the event function's docstring and the endpoint's types (web/page/ui.py
writes those docstrings with the configured shapes and step range). `mend` fixes what its answers get wrong:

- a tool call without a progress token takes Gradio's fast path, which wraps a multi-output result in one more
  list, so `generate` (image, record) would come back as the text of a tuple instead of an image and a record;
- JSON outputs come back as Python reprs (`{'replica': None}`, `root={...}`) that `json.loads` refuses, and
  `structuredContent` stays empty: here they are JSON text and the record is the structured content;
- an image comes as the whole image in base64 with a "URL" that is Gradio's file route plus the server's absolute
  path (a path leak that a remote client cannot use anyway): here it is a small preview and a `resource_link` to
  the image by its alias (web/mcp/results.py);
- progress notifications count Gradio's updates with no total: here a step is "step i of n" (web/mcp/progress.py);
- a file-list input (`edit`'s images) keeps its `$defs` inside the property while its items point at the
  schema's root (`#/$defs/FileData`): the MCP SDK's argument check fails every call with `PointerToNowhere`.
  Here every `$ref` is inlined and no `$defs` is left; and the list's files, recorded at the schema position
  `images.items`, are found at `images.0`, `images.1`... so each string (a data: or http URL) becomes a file;
- the loopback client it queues tool calls with says `X-Gradio-User: mcp`, a header any caller can send: here it
  also sends this process's secret and the MCP caller's address (web/access.py charges the call to that address).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import Any

from neuron_app.web.mcp.progress import mend_progress
from neuron_app.web.mcp.results import content_of, structured

log = logging.getLogger(__name__)
#: The structured content of the tool call running in this context (concurrent calls each have their own).
_STRUCTURED: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("mcp_structured")


def mend(
    demo: Any, local_path: Callable[[str], str] = str, public_path: Callable[[str], str | None] | None = None
) -> None:
    """Apply every mend below to a launched demo's MCP server (nothing when MCP is off). `local_path` reads an
    aliased path back, `public_path` gives a server path's alias (web/door/aliases.py's `Aliases`)."""
    server = getattr(demo, "mcp_server_obj", None)
    if server is None:
        return
    mend_multi_output(demo)
    mend_outputs(server, local_path, public_path)
    mend_progress(server)
    mend_input_schemas(server)
    mend_caller(server)


def mend_multi_output(demo: Any) -> None:
    """Give multi-output tools their outputs one by one on Gradio's no-progress path (as on its other path)."""
    server = getattr(demo, "mcp_server_obj", None)
    original = getattr(server, "_execute_tool_without_progress", None)
    if original is None or getattr(original, "_mended", False):
        return  # MCP off, or a Gradio that no longer has this path

    async def execute(job: Any) -> list[Any]:
        outputs = await original(job)
        if len(outputs) == 1 and isinstance(outputs[0], tuple):  # gradio_client's multi-output result
            return list(outputs[0])
        return outputs

    execute._mended = True  # type: ignore[attr-defined]
    server._execute_tool_without_progress = execute


def mend_outputs(
    server: Any, local_path: Callable[[str], str] = str, public_path: Callable[[str], str | None] | None = None
) -> None:
    """Answer tool calls with JSON text, previews and links, and structured content (see the module docstring)."""
    if getattr(server, "_outputs_mended", False):
        return
    types = server.types
    handlers = server.mcp_server.request_handlers
    call_request = types.CallToolRequest
    original_handler = handlers.get(call_request)
    if original_handler is None or not hasattr(server, "postprocess_output_data"):
        log.warning("Gradio's MCP server changed: its tool answers are not mended (Python reprs, file paths)")
        return

    def postprocess_output_data(data: Any, root_url: str) -> list[Any]:
        outputs = list(data)
        holder = _STRUCTURED.get(None)
        if holder is not None:
            holder["value"] = structured(outputs)
        return [
            content for output in outputs for content in content_of(output, types, local_path, public_path, root_url)
        ]

    async def handler(request: Any) -> Any:
        holder: dict[str, Any] = {}
        token = _STRUCTURED.set(holder)
        try:
            result = await original_handler(request)
        finally:
            _STRUCTURED.reset(token)
        call = getattr(result, "root", None)
        if isinstance(call, types.CallToolResult) and not call.isError and call.structuredContent is None:
            call.structuredContent = holder.get("value")
        return result

    server.postprocess_output_data = postprocess_output_data
    handlers[call_request] = handler
    server._outputs_mended = True


def inline_refs(node: Any, defs: dict[str, Any] | None = None) -> Any:
    """`node` with every `#/$defs/...` reference replaced by its definition, found wherever it is nested."""
    defs = dict(defs or {})
    if isinstance(node, list):
        return [inline_refs(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    defs.update(node.get("$defs") or {})
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/") and ref.rsplit("/", 1)[-1] in defs:
        target = inline_refs(defs[ref.rsplit("/", 1)[-1]], defs)
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return {key: inline_refs(value, defs) for key, value in node.items() if key != "$defs"}


def mend_input_schemas(server: Any) -> None:
    """Tool input schemas without dangling references (see the module docstring); FileData positions unchanged."""
    original = getattr(server, "get_input_schema", None)
    if original is None or getattr(original, "_mended", False):
        return

    def get_input_schema(tool_name: str, parameters: dict[str, str] | None = None) -> Any:
        schema, positions = original(tool_name, parameters)
        return typed_loras(inline_refs(schema)), positions

    get_input_schema._mended = True  # type: ignore[attr-defined]
    server.get_input_schema = get_input_schema
    convert = server.convert_strings_to_filedata

    def convert_strings_to_filedata(value: Any, positions: list[list[str | int]]) -> Any:
        return convert(value, [found for position in positions for found in _expand(value, position)])

    server.convert_strings_to_filedata = convert_strings_to_filedata


#: The `loras` argument as MCP clients should send it (Gradio types a JSON input as any object).
LORAS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "scale": {"type": "number"}},
        "required": ["name"],
    },
}


def typed_loras(schema: Any) -> Any:
    """A tool schema whose `loras` is the list of {name, scale} it is (its description kept)."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if isinstance(properties, dict) and "loras" in properties:
        described = {k: v for k, v in properties["loras"].items() if k in ("description", "default", "title")}
        properties["loras"] = {**LORAS_SCHEMA, **described}
    return schema


def _expand(value: Any, position: list[str | int]) -> list[list[str | int]]:
    """The argument positions a schema position names: `items` stands for every index of the list found there."""
    if not position:
        return [[]]
    head, rest = position[0], position[1:]
    if head == "items" and isinstance(value, list):
        return [[i, *tail] for i, item in enumerate(value) for tail in _expand(item, rest)]
    if isinstance(value, dict) and head in value:
        return [[head, *tail] for tail in _expand(value[head], rest)]
    return []


def mend_caller(server: Any) -> None:
    """Mark the loopback client's calls as MCP with the process secret, and name the MCP caller's address."""
    from neuron_app.web.access import MCP_CLIENT_HEADER, MCP_SECRET, MCP_SECRET_HEADER

    make_client, prepare = (
        getattr(server, "_get_or_create_client", None),
        getattr(server, "_prepare_tool_call_args", None),
    )
    if make_client is None or prepare is None or getattr(prepare, "_mended", False):
        log.warning("Gradio's MCP server changed: MCP calls are charged to the loopback address")
        return

    def get_or_create_client() -> Any:
        client = make_client()
        client.headers[MCP_SECRET_HEADER] = MCP_SECRET  # the client's own headers win over forwarded ones
        return client

    def prepare_tool_call_args(name: str, arguments: dict[str, Any]) -> Any:
        endpoint, args, headers, block_fn = prepare(name, arguments)
        request = server.mcp_server.request_context.request
        client = getattr(request, "client", None)
        headers = {k: v for k, v in headers.items() if k.lower() not in (MCP_SECRET_HEADER, MCP_CLIENT_HEADER)}
        headers[MCP_CLIENT_HEADER] = getattr(client, "host", None) or "unknown"
        return endpoint, args, headers, block_fn

    prepare_tool_call_args._mended = True  # type: ignore[attr-defined]
    server._get_or_create_client = get_or_create_client
    server._prepare_tool_call_args = prepare_tool_call_args
