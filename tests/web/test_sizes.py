"""Sizes that are not compiled (size_policy = nearest), through the openai SDK: made at the served shape nearest in
aspect ratio and area, resized and center-cropped to the asked size, with no new compile; the answer names the
served shape. `aspect_ratio` (`match_input_image` for edits) and `output_megapixels` resolve to a size."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import Any

import pytest
from PIL import Image

from neuron_app.engine.modes import sizing
from neuron_app.errors import RequestError
from neuron_app.shapes import Resolution
from tests.support import openai_client

SERVED = ["64x64", "128x128"]


@pytest.fixture(scope="module")
def nearest_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(resolutions=SERVED, default_resolution="64x64", size_policy="nearest")


def image_of(item: Any) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(item.b64_json)))


def test_size_1000x1000_is_made_at_128x128_and_resized_without_a_compile(nearest_app: Any) -> None:
    client = openai_client(nearest_app)
    client.images.generate(prompt="a fox", size="128x128", extra_body={"num_inference_steps": 1})  # compiled now
    compiles = nearest_app.manager.status().compiles
    raw = client.images.with_raw_response.generate(
        prompt="a fox", size="1000x1000", extra_body={"seed": 3, "num_inference_steps": 1}
    )
    answer, result = raw.http_response.json(), raw.parse()
    assert image_of(result.data[0]).size == (1000, 1000)
    assert (answer["size"], answer["revised_size"]) == ("1000x1000", "128x128")
    assert answer["info"] == {
        "size_policy": "nearest",
        "asked_size": "1000x1000",
        "served_size": "128x128",
        "resize": "resized to cover, then center-cropped",
    }
    provenance = result.data[0].model_extra["provenance"]
    assert (provenance["resolution"], provenance["resized_to"]) == ("128x128", "1000x1000")
    assert nearest_app.manager.status().compiles == compiles  # no new shape was compiled


def test_aspect_ratio_and_output_megapixels_resolve_to_a_size(nearest_app: Any) -> None:
    client = openai_client(nearest_app)
    extra = {"aspect_ratio": "16:9", "output_megapixels": 0.05, "num_inference_steps": 1}
    raw = client.images.with_raw_response.generate(prompt="a fox", extra_body=extra)
    answer = raw.http_response.json()
    assert image_of(raw.parse().data[0]).size == (298, 168)  # 0.05 MP at 16:9
    assert answer["revised_size"] == "128x128"  # both served shapes are 1:1: the nearer in area
    wide = Image.new("RGB", (240, 120), (30, 90, 200))
    buffer = io.BytesIO()
    wide.save(buffer, format="PNG")
    raw = client.images.with_raw_response.edit(
        image=("wide.png", buffer.getvalue(), "image/png"),
        prompt="the same, at night",
        extra_body={"aspect_ratio": "match_input_image", "num_inference_steps": 1},
    )
    assert image_of(raw.parse().data[0]).size == (91, 45)  # the input's 2:1 at the default shape's area (64x64)


def test_the_size_rules_and_exact_refuses_them(make_settings: Callable[..., Any]) -> None:
    from neuron_app.web.openai.sizes import plan_for

    default = Resolution.parse("64x64")
    assert sizing.wanted_size("1000x700", None, None, default) == (1000, 700)
    assert sizing.wanted_size(None, "1:1", 1, default) == (1000, 1000)
    for bad in ("0x10", "5000x5000", "big"):
        with pytest.raises(RequestError):
            sizing.wanted_size(bad, None, None, default)
    with pytest.raises(RequestError, match="needs an input image"):
        sizing.wanted_size(None, "match_input_image", None, default)
    assert sizing.plan(1000, 500, ["64x64", "128x64"]).served == "128x64"  # aspect ratio first
    image = sizing.fit(Image.new("RGB", (128, 64)), 90, 90)
    assert image.size == (90, 90)
    exact = make_settings(resolutions=SERVED, default_resolution="64x64")
    assert exact.size_policy == "exact" and plan_for(exact, {"size": "1000x1000"}, SERVED, {}) is None  # -> 400
    with pytest.raises(RequestError, match="need size_policy = nearest"):
        plan_for(exact, {"aspect_ratio": "16:9"}, SERVED, {})


@pytest.mark.parametrize("megapixels", [1e308, float("inf"), float("nan"), 1e9, -1])
def test_an_absurd_output_megapixels_is_a_clear_refusal(megapixels: float) -> None:
    """Issue 45, row 45: 1e308 overflowed `round` into a plain-text 500; now a RequestError (a 400) naming the range."""
    with pytest.raises(RequestError, match="output_megapixels must be a number between 0 and"):
        sizing.wanted_size(None, "1:1", megapixels, Resolution.parse("64x64"))
