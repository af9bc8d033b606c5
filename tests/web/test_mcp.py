"""The MCP tool server, driven by the official `mcp` Python SDK over Gradio's streamable HTTP endpoint."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from PIL import Image


async def _session(url: str, work: Any) -> Any:
    async with (
        streamablehttp_client(url + "gradio_api/mcp/") as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return await work(session)


def test_mcp_client_lists_and_calls_generate(launched_app: Any) -> None:
    """The tools are `generate`, `edit` and `status`, typed and documented (shapes and step range in the description,
    whole numbers typed integer); calling `generate` returns the PNG as image content and its record as JSON text and
    structured content (no server path anywhere), through the same manager as the page."""

    progress: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async def work(session: ClientSession) -> Any:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        args = {"prompt": "a fox", "resolution": "64x64", "steps": 2, "seed": 9}
        called = await session.call_tool("generate", args)
        # With a progress token Gradio takes its streaming path: the same answer, and progress on the way.
        again = await session.call_tool("generate", args, progress_callback=on_progress)
        status = await session.call_tool("status", {})
        return tools, called, again, status

    tools, called, again, status = asyncio.run(_session(launched_app.url, work))
    assert set(tools) == {"generate", "edit", "inpaint", "status", "cancel_job"}
    assert "reference images" in tools["edit"].description
    generate = tools["generate"]
    assert generate.inputSchema["required"] == ["prompt", "resolution", "steps", "seed"]
    properties = generate.inputSchema["properties"]
    assert properties["prompt"]["type"] == "string"
    assert properties["steps"]["type"] == properties["seed"]["type"] == "integer"
    assert "64x64, 128x64, 64x128, 128x128" in properties["resolution"]["description"]
    assert "from 1 to 8" in properties["steps"]["description"]
    assert "Generate one image" in generate.description

    pixels = []
    for result in (called, again):
        assert not result.isError, result.content
        images = [c for c in result.content if c.type == "image"]
        assert len(images) == 1 and images[0].mimeType == "image/png"
        image = Image.open(io.BytesIO(base64.b64decode(images[0].data)))
        assert image.size == (64, 64)
        pixels.append(image.convert("RGB").tobytes())
        texts = [c.text for c in result.content if c.type == "text"]
        (record,) = [json.loads(text) for text in texts]  # JSON, not a Python dict's repr
        assert (record["seed"], record["resolution"], record["steps"]) == (9, "64x64", 2)
        assert result.structuredContent == record
        assert str(launched_app.settings.cache_dir) not in result.model_dump_json()  # no server path (file=/...)
        assert "gradio_api/file=" not in result.model_dump_json()
    assert pixels[0] == pixels[1]  # same inputs, same image
    assert progress  # Gradio forwarded queue and progress updates
    assert launched_app.manager.status().shapes["64x64"].hits == 2
    assert not status.isError and json.loads(status.content[0].text)["shapes"]["64x64"]["state"] == "ready"
    assert status.structuredContent is not None and status.structuredContent["model"] == "tiny"


def test_mcp_edit_takes_reference_images_and_returns_an_image(launched_app: Any) -> None:
    """`edit` through the MCP SDK: its schema has no dangling `$ref` (the SDK checks arguments against it: every call
    failed with `PointerToNowhere: '/$defs/FileData' does not exist`), and a reference sent as a data: URL is
    edited into a PNG of the shape asked for."""
    buffer = io.BytesIO()
    Image.new("RGB", (96, 96), (200, 10, 10)).save(buffer, "PNG")
    reference = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")

    async def work(session: ClientSession) -> Any:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        args = {"prompt": "make it blue", "images": [reference], "resolution": "64x64", "steps": 1, "seed": 3}
        return tools["edit"], await session.call_tool("edit", args)

    tool, result = asyncio.run(_session(launched_app.url, work))
    assert "$defs" not in json.dumps(tool.inputSchema) and "$ref" not in json.dumps(tool.inputSchema)
    assert not result.isError, result.content
    (image,) = [c for c in result.content if c.type == "image"]
    assert Image.open(io.BytesIO(base64.b64decode(image.data))).size == (64, 64)
    assert result.structuredContent["references"][0]["size"] == "96x96"
