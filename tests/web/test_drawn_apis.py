"""tiny-shapes through every way in: the Gradio API (gradio_client), the OpenAI API (the `openai` SDK) and MCP
(the MCP SDK) draw what the prompt says, judged from the answered pixels."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Callable
from typing import Any

import pytest
from PIL import Image

from neuron_app.engine.model.shapes_world import EVAL_SCENES, Scene, judge
from tests.support import SHAPES_OVERRIDES, mcp_image, openai_client


@pytest.fixture(scope="module")
def drawn_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(**SHAPES_OVERRIDES)


def _right(image: Image.Image, scene: Scene, shapes: list[bool]) -> bool:
    """Both colours and the position as asked; whether the shape kind is right goes into `shapes` (the shipped
    model's squares have soft corners, which the judge sometimes reads as circles: docs/tiny-shapes.md)."""
    verdict = judge(image).matches(scene)
    print(scene.prompt, verdict)
    shapes.append(verdict["shape"])
    return verdict["colour"] and verdict["background"] and verdict["position"]


def test_gradio_api_draws_the_prompt_at_every_served_shape(drawn_app: Any) -> None:
    from gradio_client import Client

    from tests.support import PATIENT_HTTP

    client = Client(drawn_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    cases = [(scene, "128x128") for scene in EVAL_SCENES[:6]]
    cases += [
        (Scene("red", "circle", "white", "right"), "256x128"),
        (Scene("blue", "square", "black", "top"), "128x256"),
    ]
    cases += [(Scene("yellow", "circle", "purple"), "64x64"), (Scene("white", "square", "green"), "64x64")]
    right, shapes = 0, []
    for i, (scene, shape) in enumerate(cases):
        path, _info = client.predict(scene.prompt, shape, 4, 20 + i, api_name="/generate")
        with Image.open(path) as image:
            assert image.size == tuple(int(v) for v in shape.split("x"))
            right += _right(image, scene, shapes)
    assert right == len(cases), f"{right} of {len(cases)} drawn right"
    # The kind of shape is the model's weak side away from 128x128 in 4 steps (BENCHMARKS.md: 5-8 of 12 at the other
    # shapes): 5 of these 10 with the shipped weights, where a model that ignores the shape word gets about 3.
    assert sum(shapes) >= 4, f"{sum(shapes)} of {len(cases)} shapes right"


def test_openai_sdk_draws_the_prompt(drawn_app: Any) -> None:
    client = openai_client(drawn_app)
    right, shapes = 0, []
    for i, scene in enumerate(EVAL_SCENES[6:10]):
        result = client.images.generate(prompt=scene.prompt, size="128x128", extra_body={"seed": 40 + i})
        right += _right(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))), scene, shapes)
    assert right == 4 and sum(shapes) >= 2, f"{right} of 4 drawn right, {sum(shapes)} shapes"


def test_mcp_generate_draws_the_prompt(drawn_app: Any) -> None:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    scenes = EVAL_SCENES[10:12]

    async def work() -> list[Any]:
        async with (
            streamablehttp_client(drawn_app.url + "gradio_api/mcp/") as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            args = [
                {"prompt": s.prompt, "resolution": "128x128", "steps": 4, "seed": 60 + i} for i, s in enumerate(scenes)
            ]
            return [await session.call_tool("generate", a) for a in args]

    results = asyncio.run(work())
    right, shapes = 0, []
    for scene, result in zip(scenes, results, strict=True):
        assert not result.isError, result.content
        right += _right(Image.open(io.BytesIO(mcp_image(result))), scene, shapes)
    assert right == 2 and sum(shapes) >= 1, f"{right} of 2 drawn right, {sum(shapes)} shapes"
