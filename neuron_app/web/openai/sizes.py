"""The OpenAI API's sizes under `size_policy`: which served shape a `size`, `aspect_ratio` or `output_megapixels`
is made at (engine/modes/sizing.py), and what the answer says about it."""

from __future__ import annotations

import io
from typing import Any

from neuron_app.engine.modes import sizing
from neuron_app.engine.requests import AUTO_SIZE
from neuron_app.errors import RequestError
from neuron_app.settings import Settings
from neuron_app.shapes import Resolution


def _input_size(options: dict[str, Any]) -> tuple[int, int] | None:
    """The first input image's size (an edit's `match_input_image`), read from its header only."""
    from PIL import Image, UnidentifiedImageError

    first = options.get("image") or (options.get("references") or [None])[0]
    if first is None:
        return None
    try:
        with Image.open(io.BytesIO(first) if isinstance(first, bytes) else first) as image:
            return image.size
    except (OSError, UnidentifiedImageError, ValueError):
        return None  # the validation that follows says why the upload is not an image


def plan_for(settings: Settings, fields: dict[str, Any], offered: list[str], options: dict[str, Any]) -> Any:
    """A `SizePlan` when the request is made at another shape than it delivers; None for today's path (a served
    shape, `auto`, or `exact`, where anything else is refused as before)."""
    size, ratio, megapixels = fields.get("size"), fields.get("aspect_ratio"), fields.get("output_megapixels")
    if size == AUTO_SIZE:
        size = None
    if ratio is None and megapixels is None and (size is None or size in offered):
        return None
    if settings.size_policy == "exact":
        if ratio is not None or megapixels is not None:
            raise RequestError("aspect_ratio and output_megapixels need size_policy = nearest", param="size")
        return None  # a size that is not served: refused by check_size, naming the offered shapes
    default = Resolution.parse(settings.default_resolution)
    width, height = sizing.wanted_size(size, ratio, megapixels, default, _input_size(options))
    return sizing.plan(width, height, offered)


def answer_fields(size_plan: Any) -> dict[str, Any]:
    """What the answer adds: the delivered `size`, `revised_size` (the served shape it was made at) and `info`."""
    if size_plan is None:
        return {}
    return {"size": size_plan.asked, "revised_size": size_plan.served, "info": size_plan.info()}
