"""Several LoRA styles at once through every API: gradio_client's `loras` argument, the openai SDK's
`extra_body={"loras": [...]}` and the MCP SDK's typed `loras`; the same image from each, no recompile."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from PIL import Image

from tests.support import PATIENT_HTTP, mcp_image, openai_client, page_generate

LORAS = {"red": "tiny:1", "blue": "tiny:2", "green": "tiny:3"}
PROMPT, SHAPE, STEPS, SEED = "a red barn in snow", "64x64", 2, 11
BOTH = [{"name": "red", "scale": 1.0}, {"name": "blue", "scale": 0.5}]


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(loras=LORAS, max_loras_per_request=2)


@pytest.fixture(scope="module")
def client(app: Any) -> Any:
    return Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)


def rgb(data: bytes | str) -> np.ndarray:
    with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as image:
        return np.asarray(image.convert("RGB"), dtype=np.float64)


@pytest.fixture(scope="module")
def gradio_images(client: Any) -> dict[str, Any]:
    """One style, then two (the `loras` JSON argument last, after lora and lora_scale), with the records."""
    one, _one_info = client.predict(PROMPT, SHAPE, STEPS, SEED, "red", 1.0, api_name="/generate")
    both, both_info = client.predict(PROMPT, SHAPE, STEPS, SEED, "none", 1.0, BOTH, api_name="/generate")
    return {"one": rgb(one), "both": rgb(both), "both_info": both_info, "compiles": client.predict(api_name="/status")}


def test_gradio_api_takes_a_list_of_styles_after_the_old_arguments(client: Any, gradio_images: dict[str, Any]) -> None:
    info = gradio_images["both_info"]
    assert info["loras"] == BOTH and info["lora"] == "red" and info["compiled"] is False
    assert np.abs(gradio_images["both"] - gradio_images["one"]).mean() > 0.1
    compiles = gradio_images["compiles"]["compiles"]
    _path, swapped = client.predict(PROMPT, SHAPE, STEPS, SEED, "none", 1.0, BOTH[::-1], api_name="/generate")
    assert swapped["loras"] == BOTH  # the configured order: the same slots, the same image
    with pytest.raises(AppError, match="loras lists 3 styles; this server combines at most 2"):
        client.predict(PROMPT, SHAPE, STEPS, SEED, "none", 1.0, [{"name": n} for n in LORAS], api_name="/generate")
    with pytest.raises(AppError, match="LoRA style 'red' is listed twice in loras"):
        client.predict(PROMPT, SHAPE, STEPS, SEED, "none", 1.0, [{"name": "red"}] * 2, api_name="/generate")
    assert client.predict(api_name="/status")["compiles"] == compiles


def test_openai_sdk_extra_body_loras_gives_the_gradio_image(app: Any, gradio_images: dict[str, Any]) -> None:
    import openai

    api = openai_client(app)
    compiles = app.manager.status().compiles
    extra = {"seed": SEED, "num_inference_steps": STEPS, "loras": BOTH}
    result = api.images.generate(prompt=PROMPT, size=SHAPE, extra_body=extra)
    assert result.data[0].model_extra["provenance"]["loras"] == BOTH
    np.testing.assert_array_equal(rgb(base64.b64decode(result.data[0].b64_json)), gradio_images["both"])
    with pytest.raises(openai.BadRequestError) as caught:
        api.images.generate(prompt=PROMPT, size=SHAPE, extra_body={"loras": [{"name": "red", "scale": 5}]})
    assert (
        caught.value.body["param"] == "loras" and "loras must be between 0 and 2, got 5" in caught.value.body["message"]
    )
    assert app.manager.status().compiles == compiles


def test_mcp_generate_has_a_typed_loras_argument(app: Any, gradio_images: dict[str, Any]) -> None:
    async def work(session: ClientSession) -> Any:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        args = {"prompt": PROMPT, "resolution": SHAPE, "steps": STEPS, "seed": SEED, "loras": BOTH}
        return tools, await session.call_tool("generate", args)

    async def run() -> Any:
        async with (
            streamablehttp_client(app.url + "gradio_api/mcp/") as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            return await work(session)

    tools, called = asyncio.run(run())
    schema = tools["generate"].inputSchema["properties"]["loras"]
    assert schema["type"] == "array" and schema["items"]["properties"]["scale"]["type"] == "number"
    assert "Several styles at once" in schema["description"]
    assert "loras" not in tools["generate"].inputSchema.get("required", [])
    assert not called.isError, called.content
    np.testing.assert_array_equal(rgb(mcp_image(called)), gradio_images["both"])
    (text,) = [c.text for c in called.content if c.type == "text"]
    assert json.loads(text)["loras"] == BOTH


def test_the_page_combines_its_style_pairs(app: Any) -> None:
    """The page shows one (style, scale) pair per slot (two here); its Generate sends both, the result line names
    both, and a style chosen twice is the engine's one clear refusal."""
    labels = [b.label for b in app.demo.blocks.values() if getattr(b, "elem_id", None) in ("lora", "lora-2")]
    assert sorted(labels) == ["Style (LoRA)", "Style 2 (LoRA)"]
    form = [PROMPT, SHAPE, STEPS, SEED, 1, False]
    message = page_generate(app, form, style=("red", 1.0), more=("blue", 0.5))
    assert message["success"] is True, message
    assert "LoRA red x1 + blue x0.5" in message["output"]["data"][1]
    refused = page_generate(app, form, style=("red", 1.0), more=("red", 0.5))
    assert refused["success"] is False and "'red' is listed twice" in refused["output"]["error"]
    single = page_generate(app, form, style=("blue", 1.0))
    assert (
        "LoRA blue x1" in single["output"]["data"][1] and "+" not in single["output"]["data"][1].split("LoRA")[1][:12]
    )
