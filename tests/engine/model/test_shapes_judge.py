"""The judge the image tests rely on (shapes_world.judge) reads every rendered scene right: a judged test's failure
is then the model's, not the judge's."""

from __future__ import annotations

import itertools

import pytest
from PIL import Image

from neuron_app.engine.model.shapes_world import POSITIONS, SHAPES, Scene, judge, render

#: Colour pairs that span the palette, yellow on orange (the nearest pair) among them.
PAIRS = [("red", "green"), ("yellow", "orange"), ("blue", "yellow"), ("white", "black"), ("purple", "white")]
LOOKS = [
    ("medium", (128, 128), False),
    ("small", (256, 128), False),
    ("large", (128, 256), True),
    ("small", (64, 64), True),
]


@pytest.mark.parametrize(("size", "pixels", "outline"), LOOKS, ids=[f"{s}-{w}x{h}" for s, (w, h), _ in LOOKS])
def test_the_judge_reads_every_rendered_scene(size: str, pixels: tuple[int, int], outline: bool) -> None:
    """Every kind and position, filled and as an outline, on near and far colour pairs, at the served aspects and
    the smallest size: colour, background, kind, position and style all read back."""
    wrong = []
    for (colour, background), shape, position in itertools.product(PAIRS, SHAPES, POSITIONS):
        scene = Scene(colour, shape, background, position, size, outline)
        reading = judge(render(scene, *pixels))
        if not all(reading.matches(scene).values()) or reading.outline != outline:
            wrong.append((scene, reading))
    assert not wrong, wrong[:3]


def test_the_judge_sees_nothing_on_a_plain_background() -> None:
    reading = judge(Image.new("RGB", (128, 128), (240, 220, 40)))
    assert (reading.background, reading.shape, reading.colour) == ("yellow", None, None)
