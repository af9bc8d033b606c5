"""The MCP tool server, driven by the official `mcp` Python SDK over Gradio's streamable HTTP endpoint."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import httpx
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
    whole numbers typed integer); calling `generate` returns a small WebP preview (with the IPTC source type), a
    resource link that any HTTP client fetches the PNG from, and the record as JSON text and structured content
    (no server path anywhere), through the same manager as the page."""
    from neuron_app.engine.trust.marks import DIGITAL_SOURCE_TYPE, read_source_type

    progress: list[tuple[float, float | None, str]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message or ""))

    stepped: list[tuple[float, float | None, str]] = []

    async def on_step(done: float, total: float | None, message: str | None) -> None:
        stepped.append((done, total, message or ""))

    async def work(session: ClientSession) -> Any:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        args = {"prompt": "a fox", "resolution": "64x64", "steps": 2, "seed": 9}
        called = await session.call_tool("generate", args)
        # With a progress token Gradio takes its streaming path: the same answer, and progress on the way.
        again = await session.call_tool("generate", args, progress_callback=on_progress)
        eight = await session.call_tool("generate", args | {"steps": 8}, progress_callback=on_step)
        status = await session.call_tool("status", {})
        return tools, called, again, eight, status

    tools, called, again, eight, status = asyncio.run(_session(launched_app.url, work))
    assert not eight.isError, eight.content
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
        assert [c.type for c in result.content] == ["image", "resource_link", "text"]
        preview, link, text = result.content
        assert preview.mimeType == "image/webp"
        small = Image.open(io.BytesIO(base64.b64decode(preview.data)))
        assert small.format == "WEBP" and max(small.size) <= 128
        assert read_source_type(small) == DIGITAL_SOURCE_TYPE
        assert link.mimeType == "image/png"
        assert str(link.uri).startswith(launched_app.url + "gradio_api/file=/@outputs/")
        fetched = httpx.get(str(link.uri))  # the link, as any HTTP client follows it
        assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
        assert link.size == len(fetched.content)
        image = Image.open(io.BytesIO(fetched.content))
        assert image.size == (64, 64) and image.text["seed"] == "9"  # the image this call made
        # the preview shows that image (lossy WebP: close, not equal)
        expected, shown = image.convert("RGB").tobytes(), small.convert("RGB").resize(image.size).tobytes()
        assert sum(abs(a - b) for a, b in zip(expected, shown, strict=True)) / len(expected) < 16
        pixels.append(expected)
        record = json.loads(text.text)  # JSON, not a Python dict's repr
        assert (record["seed"], record["resolution"], record["steps"]) == (9, "64x64", 2)
        assert result.structuredContent == record  # the OpenAI API's `provenance`: seed, size, cache, seconds...
        assert {"cache", "inference_s", "usage"} <= set(record)
        assert str(launched_app.settings.cache_dir) not in result.model_dump_json()  # no server path (file=/...)
    assert pixels[0] == pixels[1]  # same inputs, same image
    # A progress token gets the queue's updates and the denoising steps as "step i of n"; progress only increases.
    values = [done for done, _total, _message in progress]
    assert values and values == sorted(set(values)), progress
    # Gradio samples progress every 10 ms, so a step of a few ms may merge into the next: 8 steps, some seen
    steps = [(done, total) for done, total, _message in stepped if total is not None]
    assert steps and all(total == 8.0 and done in range(1, 9) for done, total in steps), stepped
    assert launched_app.manager.status().shapes["64x64"].hits == 3
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
    (link,) = [c for c in result.content if c.type == "resource_link"]
    assert Image.open(io.BytesIO(httpx.get(str(link.uri)).content)).size == (64, 64)
    assert result.structuredContent["references"][0]["size"] == "96x96"


def test_step_progress_only_increases_and_gives_steps_a_total() -> None:
    """The notes sent for Gradio's updates: a step is (step, steps); any other update advances by less than a step,
    so a step that Gradio merged away, or one repeated, never makes progress go back."""
    from types import SimpleNamespace

    from neuron_app.web.mcp.progress import StepProgress

    notes = StepProgress()
    unit = SimpleNamespace
    sent = [
        notes.note(None, "In queue"),
        notes.note(unit(index=None, length=None, desc="Loading"), "Loading"),
        notes.note(unit(index=2, length=4, desc="Step 2/4"), "Step 2 of 4"),  # step 1 merged away
        notes.note(unit(index=2, length=4, desc="Step 2/4"), "Step 2 of 4"),  # the same step again: not sent
        notes.note(unit(index=4, length=4, desc="Step 4/4"), "Step 4 of 4"),
        notes.note(unit(index=None, length=None, desc="Decoding"), "Decoding"),
    ]
    assert sent[3] is None
    kept = [note for note in sent if note is not None]
    assert [note.progress for note in kept] == sorted({note.progress for note in kept})
    assert [(note.progress, note.total) for note in kept if note.total] == [(2.0, 4.0), (4.0, 4.0)]
    assert kept[0].progress < kept[1].progress < 1 and 4 < kept[-1].progress < 5
