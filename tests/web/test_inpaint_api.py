"""Inpainting through the real clients: the openai SDK (`images.edit` with `mask`), gradio_client (`inpaint`) and
the MCP SDK (the `inpaint` tool), against the launched tiny app."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from tests.support import PICTURE_SIZE as SIZE
from tests.support import halves, left_half_mask, mcp_image, png, source_image

SHAPE = f"{SIZE}x{SIZE}"


def decoded(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    app = launch_tiny(mcp_server=True)
    app.manager.generate("warm", SHAPE, 2, 0)  # the shape compiled for text-to-image
    return app


@pytest.fixture(scope="module")
def client(app: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.url + "v1", api_key="unused", max_retries=0, timeout=300)


def test_openai_edit_with_a_mask_keeps_the_unmasked_half(app: Any, client: openai.OpenAI) -> None:
    compiles = app.manager.status().compiles
    source = source_image()
    src_left, src_right = halves(source)
    for prompt, seed in (("a red door", 5), ("a field of flowers", 11)):
        result = client.images.edit(
            image=("source.png", png(source), "image/png"),
            mask=("mask.png", left_half_mask(), "image/png"),
            prompt=prompt,
            size=SHAPE,  # type: ignore[arg-type]
            extra_body={"seed": seed, "num_inference_steps": 2},
        )
        image = decoded(result.data[0].b64_json)
        assert image.size == (SIZE, SIZE)
        left, right = halves(image)
        assert np.array_equal(right, src_right)  # outside the mask: the input's pixels
        assert np.abs(left - src_left).mean() > 10  # the masked half is new
    assert app.manager.status().compiles == compiles  # the text-to-image graph served it


def test_openai_mask_of_another_size_is_400_naming_mask(app: Any, client: openai.OpenAI) -> None:
    compiles = app.manager.status().compiles
    with pytest.raises(openai.BadRequestError, match="must be the image's size") as caught:
        client.images.edit(
            image=("source.png", png(source_image()), "image/png"),
            mask=("mask.png", left_half_mask(32), "image/png"),
            prompt="a red door",
        )
    assert caught.value.body["param"] == "mask"
    with pytest.raises(openai.BadRequestError, match="mask is not a readable image") as caught:
        client.images.edit(
            image=("source.png", png(source_image()), "image/png"),
            mask=("mask.png", b"\x89PNG\r\n\x1a\n truncated", "image/png"),
            prompt="a red door",
        )
    assert caught.value.body["param"] == "mask"
    assert app.manager.status().compiles == compiles


def test_openai_strength_without_a_mask_is_image_to_image(app: Any, client: openai.OpenAI) -> None:
    compiles = app.manager.status().compiles
    out = {}
    for strength in (0.25, 1.0):
        result = client.images.edit(
            image=("source.png", png(source_image()), "image/png"),
            prompt="a fox",
            size=SHAPE,  # type: ignore[arg-type]
            extra_body={"seed": 3, "num_inference_steps": 4, "strength": strength},
        )
        out[strength] = np.asarray(decoded(result.data[0].b64_json).convert("RGB"))
    text_only = np.asarray(app.manager.generate("a fox", SHAPE, 4, 3).image)
    assert np.array_equal(out[1.0], text_only)  # strength 1: the image is fully noised
    assert not np.array_equal(out[0.25], text_only)
    assert app.manager.status().compiles == compiles
    with pytest.raises(openai.BadRequestError, match="strength must be between 0 and 1") as caught:
        client.images.edit(
            image=("source.png", png(source_image()), "image/png"), prompt="a fox", extra_body={"strength": 2}
        )
    assert caught.value.body["param"] == "strength"


def test_gradio_client_inpaint(app: Any, tmp_path: Any) -> None:
    from gradio_client import Client, handle_file

    from tests.support import PATIENT_HTTP

    (tmp_path / "source.png").write_bytes(png(source_image()))
    (tmp_path / "mask.png").write_bytes(left_half_mask())
    compiles = app.manager.status().compiles
    client = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    path, record = client.predict(
        "a red door",
        handle_file(str(tmp_path / "source.png")),
        handle_file(str(tmp_path / "mask.png")),
        SHAPE,
        2,
        5,
        api_name="/inpaint",
    )
    assert record["resolution"] == SHAPE and record["seed"] == 5 and record["source"]["masked"] is True
    assert "source" in Image.open(path).text  # the PNG says which image was inpainted
    assert np.array_equal(halves(Image.open(path))[1], halves(source_image())[1])
    assert app.manager.status().compiles == compiles
    with pytest.raises(Exception, match="must be the image's size"):
        (tmp_path / "small.png").write_bytes(left_half_mask(32))
        client.predict(
            "a red door",
            handle_file(str(tmp_path / "source.png")),
            handle_file(str(tmp_path / "small.png")),
            SHAPE,
            2,
            5,
            api_name="/inpaint",
        )


def test_mcp_inpaint_tool(app: Any) -> None:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    def data_url(data: bytes) -> str:
        return "data:image/png;base64," + base64.b64encode(data).decode("ascii")

    async def work() -> Any:
        async with (
            streamablehttp_client(app.url + "gradio_api/mcp/") as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            tools = {tool.name: tool for tool in (await session.list_tools()).tools}
            args = {
                "prompt": "a red door",
                "image": data_url(png(source_image())),
                "mask": data_url(left_half_mask()),
                "resolution": SHAPE,
                "steps": 2,
                "seed": 5,
            }
            return tools, await session.call_tool("inpaint", args)

    tools, result = asyncio.run(work())
    assert "inpaint" in tools and "transparent" in tools["inpaint"].inputSchema["properties"]["mask"]["description"]
    assert not result.isError, result.content
    image = Image.open(io.BytesIO(mcp_image(result)))
    assert np.array_equal(halves(image)[1], halves(source_image())[1])


def test_page_shows_step_previews_in_the_gallery_then_the_image(app: Any) -> None:
    """The page's own Generate event (the browser's, through the queue): before the final image the gallery
    receives a preview per step, at a quarter of the image's size, and nothing new compiles."""
    import json
    import re
    import uuid

    import httpx

    fn_index, fn = next((fid, fn) for fid, fn in app.demo.fns.items() if fn.name == "ui_generate")
    data: list[Any] = ["a fox", "128x64", 3, 4, 1, False]
    data += [getattr(component, "value", None) for component in fn.inputs[len(data) :]]
    app.manager.generate("warm", "128x64", 1, 0)
    compiles = app.manager.status().compiles
    session = uuid.uuid4().hex[:12]
    body = {"data": data, "fn_index": fn_index, "session_hash": session, "trigger_id": None, "event_data": None}
    urls: list[str] = []  # the gallery's images in order: full values and Gradio's diffs both carry the url
    with httpx.Client(timeout=120) as http:
        http.post(app.url + "gradio_api/queue/join", json=body).raise_for_status()
        with http.stream("GET", app.url + "gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                message = json.loads(line[5:]) if line.startswith("data:") else {}
                gallery = json.dumps(((message.get("output") or {}).get("data") or [None])[0])
                urls += [u for u in re.findall(r'"(http[^"]+/gradio_api/file=[^"]+[.]png)"', gallery) if u not in urls]
                if message.get("msg") == "process_completed":
                    assert message["success"], message
                    break
        sizes = [Image.open(io.BytesIO(http.get(url).content)).size for url in urls]
    assert sizes[-1] == (128, 64)  # the image
    assert sizes[:-1] and set(sizes[:-1]) == {(32, 16)}, sizes  # previews before it, a quarter a side
    assert app.manager.status().compiles == compiles
