"""An image tool's answer as MCP clients use it: a small inline preview, a link to the image, the record as JSON.

An image answered only as base64 fills an agent's context (a 1024x1024 PNG is over a megabyte of text) and cannot
be handed on; a server path is useless to a remote client. So each image output becomes two content blocks:

- an `image` block: a preview at most PREVIEW_PX on its longer side, as WebP (a few kB), carrying the same IPTC
  digital source type (trainedAlgorithmicMedia) as the image it was made from;
- a `resource_link` block: the URL of the image itself (the PNG the page shows, every mark in it), at
  `/gradio_api/file=/@outputs/<name>` on the server the client called (web/door/ serves the alias; no server path
  is shown). Any HTTP client fetches it, for as long as `outputs_dir` keeps it (`outputs_keep`).

The record (seed, resolution, steps, cache, seconds, usage: the OpenAI API's `provenance`) is JSON text and the
result's `structuredContent` (web/mcp/tools.py).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

#: The preview's longer side at most, in pixels: a thumbnail a chat shows inline, not the image.
PREVIEW_PX = 128
PREVIEW_MIME = "image/webp"
#: WebP quality of the preview: small (2-5 kB at 128 px), still recognisable.
PREVIEW_QUALITY = 80


def is_file_data(output: Any) -> bool:
    return isinstance(output, dict) and output.get("meta", {}).get("_type") == "gradio.FileData"


def preview_bytes(path: Path) -> bytes:
    """A WebP preview of a PNG, at most PREVIEW_PX on its longer side (never enlarged), with the PNG's XMP packet
    (IPTC digital source type) in WebP's XMP chunk."""
    from PIL import Image

    from neuron_app.engine.trust.marks import XMP_KEY

    with Image.open(path) as image:
        xmp = image.info.get(XMP_KEY) or image.info.get("xmp") or ""
        small = image.convert("RGB")
        small.thumbnail((PREVIEW_PX, PREVIEW_PX))
    buffer = io.BytesIO()
    extra = {"xmp": xmp.encode() if isinstance(xmp, str) else xmp} if xmp else {}
    small.save(buffer, format="WEBP", quality=PREVIEW_QUALITY, **extra)
    return buffer.getvalue()


def image_link(root_url: str, public_path: str) -> str:
    """The URL a client fetches an aliased output at (Gradio's file route, through the door's alias)."""
    return f"{root_url.rstrip('/')}/gradio_api/file={quote(public_path, safe='/@')}"


def content_of(
    output: Any,
    types: Any,
    local_path: Callable[[str], str] = str,
    public_path: Callable[[str], str | None] | None = None,
    root_url: str = "",
) -> list[Any]:
    """One tool output as MCP content: an image as a preview and a link to it (module docstring), data as JSON
    text. `local_path` reads an answer's aliased path back; `public_path` gives a server path's alias."""
    if is_file_data(output):
        path = Path(local_path(str(output.get("path") or "")))  # answers name files by alias (web/door/)
        if path.suffix.lower() == ".png" and path.is_file():
            data = base64.b64encode(preview_bytes(path)).decode("ascii")
            blocks: list[Any] = [types.ImageContent(type="image", data=data, mimeType=PREVIEW_MIME)]
            alias = public_path(str(path)) if public_path is not None else None
            if alias and root_url:
                blocks.append(
                    types.ResourceLink(
                        type="resource_link",
                        uri=image_link(root_url, alias),
                        name=path.name,
                        mimeType="image/png",
                        size=path.stat().st_size,
                        description="the image itself (PNG, with its AI-content marks); the inline image is a preview",
                    )
                )
            return blocks
        return [types.TextContent(type="text", text=json.dumps({"file": path.name}))]
    value = plain(output)
    if isinstance(value, str):
        return [types.TextContent(type="text", text=value)]
    return [types.TextContent(type="text", text=json.dumps(value, default=str))]


def plain(value: Any) -> Any:
    """A JSON output as plain data: Gradio's `JsonData` (a pydantic root model) on its direct path, a dict on
    the client path."""
    dump = getattr(value, "model_dump", None)
    return dump() if callable(dump) else value


def structured(outputs: list[Any]) -> dict[str, Any] | None:
    """The structured content of a result: its one JSON object (generate's record, the status), if any."""
    objects = [value for value in map(plain, outputs) if isinstance(value, dict) and "meta" not in value]
    return objects[0] if len(objects) == 1 else None
