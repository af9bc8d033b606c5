"""Any size a caller asks for, from the shapes that are compiled (`size_policy = nearest`): the request is made at
the served shape nearest in aspect ratio and area, then resized and center-cropped to the asked size, so no new
shape is ever compiled. Hosted klein APIs take `aspect_ratio` (`16:9`, `match_input_image`) and
`output_megapixels`; they resolve to a size here, and so does a free `WIDTHxHEIGHT`."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from neuron_app.engine.modes.references import nearest
from neuron_app.errors import RequestError
from neuron_app.shapes import Resolution

#: The largest side and area an asked size may have (a resize, not a compile, but still memory and a PNG).
MAX_SIDE, MAX_MEGAPIXELS = 4096, 16.0
MIN_SIDE = 16
MATCH_INPUT = "match_input_image"
_RATIO = re.compile(r"^\s*(\d{1,3})\s*:\s*(\d{1,3})\s*$")
_SIZE = re.compile(r"^\s*(\d{1,5})\s*x\s*(\d{1,5})\s*$")


@dataclass(frozen=True)
class SizePlan:
    """What a request is made at (`served`, an offered shape) and what it delivers (`width` x `height`)."""

    served: str
    width: int
    height: int

    @property
    def asked(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def resized(self) -> bool:
        return self.asked != self.served

    def info(self) -> dict[str, Any]:
        """What was done, for the answer: the asked size, the served shape, and how one became the other."""
        how = "as served" if not self.resized else "resized to cover, then center-cropped"
        return {"size_policy": "nearest", "asked_size": self.asked, "served_size": self.served, "resize": how}


def _ratio(text: Any, input_size: tuple[int, int] | None) -> float:
    if text == MATCH_INPUT:
        if input_size is None:
            raise RequestError(f"aspect_ratio {MATCH_INPUT!r} needs an input image (an edit)", param="aspect_ratio")
        return input_size[0] / input_size[1]
    found = _RATIO.match(text) if isinstance(text, str) else None
    if not found or not int(found[1]) or not int(found[2]):
        raise RequestError(
            f"aspect_ratio must be 'W:H' such as '1:1', '16:9', '3:4', or {MATCH_INPUT!r}", param="aspect_ratio"
        )
    return int(found[1]) / int(found[2])


def wanted_size(
    size: Any, aspect_ratio: Any, megapixels: Any, default: Resolution, input_size: tuple[int, int] | None = None
) -> tuple[int, int]:
    """The pixels the caller asks for: `size` as WIDTHxHEIGHT, else `aspect_ratio` at `output_megapixels` (each
    defaulting to the default shape's); refused when out of bounds."""
    if size is not None and (aspect_ratio is not None or megapixels is not None):
        raise RequestError("give size, or aspect_ratio and output_megapixels, not both", param="size")
    if size is not None:
        found = _SIZE.match(size) if isinstance(size, str) else None
        if not found:
            raise RequestError("size must be WIDTHxHEIGHT, e.g. '1000x1000', or 'auto'", param="size")
        width, height = int(found[1]), int(found[2])
    else:
        ratio = default.width / default.height if aspect_ratio is None else _ratio(aspect_ratio, input_size)
        if megapixels is None:
            area = default.width * default.height
        elif (
            isinstance(megapixels, bool)
            or not isinstance(megapixels, int | float)
            or not 0 < megapixels <= MAX_MEGAPIXELS  # 1e308 overflowed round() into a 500 (issue 45, row 45)
        ):
            raise RequestError(f"output_megapixels must be a number between 0 and {MAX_MEGAPIXELS:g}", param="size")
        else:
            area = megapixels * 1_000_000
        width, height = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
    if not (min(width, height) >= MIN_SIDE and max(width, height) <= MAX_SIDE) or width * height > MAX_MEGAPIXELS * 1e6:
        raise RequestError(
            f"size {width}x{height} is out of bounds: sides {MIN_SIDE} to {MAX_SIDE} px, at most "
            f"{MAX_MEGAPIXELS:g} megapixels",
            param="size",
        )
    return width, height


def plan(width: int, height: int, offered: list[str]) -> SizePlan:
    """The served shape nearest in aspect ratio, then area (the rule `resolution = auto` follows for edits)."""
    if not offered:
        raise RequestError("no shape is offered right now", param="size")
    served = nearest(width, height, [Resolution.parse(name) for name in offered])
    return SizePlan(str(served), width, height)


def fit(image: Any, width: int, height: int) -> Any:
    """`image` (PIL) scaled to cover width x height (Lanczos), then center-cropped to it: no stretching."""
    from PIL import Image

    if image.size == (width, height):
        return image
    scale = max(width / image.width, height / image.height)
    scaled = image.resize(
        (max(width, round(image.width * scale)), max(height, round(image.height * scale))), Image.LANCZOS
    )
    left, top = (scaled.width - width) // 2, (scaled.height - height) // 2
    return scaled.crop((left, top, left + width, top + height))


def fit_record(record: Any, size_plan: SizePlan | None) -> Any:
    """A generation record whose image is delivered at the plan's size (`resized_to` says so); unchanged without."""
    if size_plan is None or not size_plan.resized:
        return record
    image = fit(record.image, size_plan.width, size_plan.height)
    return dataclasses.replace(record, image=image, resized_to=size_plan.asked)
