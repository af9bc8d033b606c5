"""The world `tiny-shapes` is trained on: coloured shapes on a plain background, described by a small grammar.

`a {colour} {shape} on a {colour} background`, then an optional position (`on the left`, `on the right`, `at the
top`, `at the bottom`; centre when unsaid), with an optional size word before the shape (`small`, `large`). The
same module renders a scene with Pillow at any size and reads one back (`judge`), so training, the tests and the
bench agree on what a prompt means. Pure Python and Pillow: no torch here.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from typing import Any

#: Clearly distinct RGB values (docs/tiny-shapes.md lists them).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 220, 40),
    "orange": (245, 140, 30),
    "purple": (140, 50, 180),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS: dict[str, tuple[float, float]] = {
    "centre": (0.5, 0.5),
    "left": (0.3, 0.5),
    "right": (0.7, 0.5),
    "top": (0.5, 0.3),
    "bottom": (0.5, 0.7),
}
POSITION_WORDS = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}
#: Half the shape's extent, as a fraction of the image's shorter side.
SIZES = {"small": 0.15, "medium": 0.22, "large": 0.29}
#: The words the tokenizer keeps whole (tiny.py): the grammar's and the edit instruction's.
WORDS = (*COLOURS, *SHAPES, "a", "on", "the", "at", "background", "left", "right", "top", "bottom")
WORDS += ("small", "large", "make", "outline", "of", "user", "assistant")
#: The outline style's stroke, as a fraction of the half extent.
OUTLINE_WIDTH = 0.28


@dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    background: str
    position: str = "centre"
    size: str = "medium"
    outline: bool = False

    def __post_init__(self) -> None:
        if self.colour == self.background:
            raise ValueError("the shape and the background differ in colour")

    @property
    def prompt(self) -> str:
        size = "" if self.size == "medium" else f"{self.size} "
        where = "" if self.position == "centre" else f" {POSITION_WORDS[self.position]}"
        return f"a {size}{self.colour} {self.shape} on a {self.background} background{where}"


_PROMPT = re.compile(
    r"^\s*an?\s+(?:(small|large)\s+)?(\w+)\s+(\w+)\s+on\s+an?\s+(\w+)\s+background"
    r"(?:\s+(?:on the (left|right)|at the (top|bottom)))?\s*\.?\s*$",
    re.IGNORECASE,
)
_EDIT = re.compile(r"^\s*make the (\w+) (\w+)\s*\.?\s*$", re.IGNORECASE)


def parse(prompt: str) -> Scene | None:
    """The scene a prompt of the grammar describes, or None for any other text."""
    match = _PROMPT.match(prompt)
    if not match:
        return None
    size, colour, shape, background, side, edge = (g.lower() if g else g for g in match.groups())
    if colour not in COLOURS or background not in COLOURS or shape not in SHAPES or colour == background:
        return None
    return Scene(colour, shape, background, side or edge or "centre", size or "medium")


def parse_edit(prompt: str) -> tuple[str, str] | None:
    """`make the {shape} {colour}`: (shape, colour), or None."""
    match = _EDIT.match(prompt)
    if not match or match.group(1).lower() not in SHAPES or match.group(2).lower() not in COLOURS:
        return None
    return match.group(1).lower(), match.group(2).lower()


def edited(scene: Scene, colour: str) -> Scene:
    """The scene after `make the {shape} {colour}` (a recolour to the background's colour is not an edit)."""
    return replace(scene, colour=colour)


def random_scene(rng: random.Random, positions: bool = True, sizes: bool = True) -> Scene:
    colour, background = rng.sample(list(COLOURS), 2)
    position = rng.choice(list(POSITIONS)) if positions and rng.random() < 0.6 else "centre"
    size = rng.choice(["small", "large"]) if sizes and rng.random() < 0.35 else "medium"
    return Scene(colour, rng.choice(SHAPES), background, position, size)


def geometry(scene: Scene, width: int, height: int, jitter: tuple[float, float, float] = (0.0, 0.0, 0.0)):
    """(cx, cy, r): the centre and half extent in pixels; jitter moves and scales by fractions."""
    fx, fy = POSITIONS[scene.position]
    r = SIZES[scene.size] * min(width, height) * (1 + jitter[2])
    return fx * width + jitter[0] * width, fy * height + jitter[1] * height, r


def render(scene: Scene, width: int, height: int, jitter: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> Any:
    """The scene as a PIL RGB image, drawn at 4x and reduced (smooth edges, like a decoder's)."""
    from PIL import Image, ImageDraw

    k = 4
    image = Image.new("RGB", (width * k, height * k), COLOURS[scene.background])
    draw = ImageDraw.Draw(image)
    cx, cy, r = (v * k for v in geometry(scene, width, height, jitter))
    fill = COLOURS[scene.colour]
    width_px = max(k, int(OUTLINE_WIDTH * r * (0.8 if scene.shape == "triangle" else 1.0)))
    style = {"outline": fill, "width": width_px} if scene.outline else {"fill": fill}
    box = [cx - r, cy - r, cx + r, cy + r]
    if scene.shape == "circle":
        draw.ellipse(box, **style)
    elif scene.shape == "square":
        draw.rectangle(box, **style)
    else:  # its centroid at the scene's centre: apex 1.2 r above it, base 0.6 r below
        draw.polygon([(cx, cy - 1.2 * r), (cx + r, cy + 0.6 * r), (cx - r, cy + 0.6 * r)], **style)
    return image.resize((width, height), Image.Resampling.BOX)


def _distance(a: Any, b: Any) -> float:
    return sum((float(x) - float(y)) ** 2 for x, y in zip(a, b, strict=True)) ** 0.5


def nearest_colour(rgb: Any, exclude: str | None = None) -> str:
    return min((c for c in COLOURS if c != exclude), key=lambda name: _distance(rgb, COLOURS[name]))


@dataclass(frozen=True)
class Reading:
    """What `judge` sees in an image; `shape` is None when nothing stands out of the background."""

    background: str
    colour: str | None
    shape: str | None
    position: str | None
    fill: float
    outline: bool
    area: float  # the shape's share of the image

    def matches(self, scene: Scene) -> dict[str, bool]:
        return {
            "background": self.background == scene.background,
            "colour": self.colour == scene.colour,
            "shape": self.shape == scene.shape,
            "position": self.position == scene.position,
        }


def judge(image: Any, threshold: float = 90.0) -> Reading:
    """Read a scene back: the background is the border's colour; the shape is the set of pixels far from it, named
    by the nearest colour; its kind from how much of its bounding box it fills; its position from its centroid."""
    import numpy as np

    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    height, width, _ = pixels.shape
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    background = np.median(border, axis=0)
    bg_name = nearest_colour(background)
    # Far from the background: half the way to the palette colour nearest it (yellow and orange are close).
    gap = min(_distance(COLOURS[bg_name], rgb) for name, rgb in COLOURS.items() if name != bg_name)
    mask = np.sqrt(((pixels - background) ** 2).sum(axis=2)) > min(threshold, gap / 2)
    if mask.sum() < 0.004 * width * height:
        return Reading(bg_name, None, None, None, 0.0, False, 0.0)
    ys, xs = np.nonzero(mask)
    # The shape's colour from its core: the masked pixels farthest from the background (a soft edge mixes the two
    # colours), named by the nearest palette colour other than the background's.
    distance = np.sqrt(((pixels[mask] - background) ** 2).sum(axis=1))
    core = pixels[mask][distance >= np.percentile(distance, 75)]
    colour = nearest_colour(np.median(core, axis=0), exclude=bg_name)
    x0, x1 = (int(v) for v in np.percentile(xs, [1, 99]))
    y0, y1 = (int(v) for v in np.percentile(ys, [1, 99]))
    inside = mask[y0 : y1 + 1, x0 : x1 + 1]
    # Every shape is convex: filling each row between its first and last pixel gives the solid shape, whose share
    # of its box names the kind (square 1, circle pi/4, triangle 1/2) whether it was drawn filled or as an outline.
    cols = np.arange(inside.shape[1])
    rows = inside.any(axis=1)
    first = np.where(rows, inside.argmax(axis=1), 0)
    last = np.where(rows, inside.shape[1] - 1 - inside[:, ::-1].argmax(axis=1), -1)
    solid = (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None])
    fill = float(solid.sum() / max(1, solid.size))
    outline = bool(inside.sum() < 0.75 * max(1, solid.sum()))
    shape = "square" if fill > 0.9 else ("circle" if fill > 0.7 else "triangle")
    cx, cy = xs.mean() / width, ys.mean() / height
    dx, dy = cx - 0.5, cy - 0.5
    if max(abs(dx), abs(dy)) < 0.1:
        position = "centre"
    elif abs(dx) >= abs(dy):
        position = "left" if dx < 0 else "right"
    else:
        position = "top" if dy < 0 else "bottom"
    return Reading(bg_name, colour, shape, position, fill, outline, float(mask.mean()))


#: A fixed set of 12 prompts: every colour as shape and as background, every shape four times, some positions.
EVAL_SCENES: tuple[Scene, ...] = (
    Scene("purple", "circle", "yellow"),
    Scene("red", "square", "blue"),
    Scene("green", "triangle", "white"),
    Scene("yellow", "circle", "black"),
    Scene("orange", "square", "purple"),
    Scene("blue", "triangle", "orange"),
    Scene("white", "circle", "red"),
    Scene("black", "square", "green"),
    Scene("red", "triangle", "yellow", "right"),
    Scene("blue", "circle", "white", "left"),
    Scene("green", "square", "black", "top"),
    Scene("purple", "triangle", "white", "bottom"),
)
