"""The source image and mask of an inpaint or image-to-image request: safe uploads, fitted to the output shape.

The source is opened like a reference (`engine/modes/references.py`: size limit, pixel limit from the header before
decoding, EXIF orientation, RGB, at least 64 px a side, aspect <= 8:1), then resized to cover the requested
output shape and center-cropped: the denoised latents are the output's, so the graph is text-to-image's.

The mask follows OpenAI's rule: a PNG the source's size whose fully transparent pixels (alpha 0) mark what to
edit. A mask without transparency (no alpha channel, or every pixel opaque) is read the diffusers/ComfyUI way:
white (>= 128) marks what to edit. It is fitted with the same crop as the source. Every refusal is a
`RequestError` with `param` "image" or "mask".
"""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from neuron_app.engine.modes import references as refs
from neuron_app.errors import RequestError
from neuron_app.settings import MIN_REFERENCE_SIDE, Settings
from neuron_app.shapes import Resolution

#: How far (pixels) the generated region fades into the source inside the mask's edge; outside it, the answer's
#: pixels are the source's exactly.
FEATHER_PX = 4


@dataclass(frozen=True)
class InpaintSource:
    """`image`: RGB at the output shape; `mask`: "L" at the output shape, 255 = edit, or None (image-to-image)."""

    image: Any
    mask: Any
    size: str
    sha256: str
    edit_fraction: float  # share of the output's pixels the mask marks for editing (1.0 without a mask)
    upload: Any = field(default=None, repr=False, compare=False)
    mask_upload: Any = field(default=None, repr=False, compare=False)

    def info(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "sha256": self.sha256,
            "masked": self.mask is not None,
            "edit_fraction": round(self.edit_fraction, 4),
        }


def _open(settings: Settings, source: Any, label: str, param: str) -> tuple[Any, Any, str]:
    """Decode one upload safely: the oriented PIL image (mode kept), what was uploaded, and its SHA-256."""
    from PIL import Image, UnidentifiedImageError

    try:
        data, image = refs._read_source(settings, source, label)
    except RequestError as exc:
        raise RequestError(exc.message, param=param) from None
    unreadable = f"{label} is not a readable image (unknown format, truncated or corrupt)"
    bomb = f"{label} has too many pixels; the limit is {settings.max_reference_pixels:,} (width x height)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own, lower limit decides
            if image is None:
                image = Image.open(io.BytesIO(data))  # the header only
    except Image.DecompressionBombError:
        raise RequestError(bomb, param=param) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError):
        raise RequestError(unreadable, param=param) from None
    width, height = image.size
    if width * height > settings.max_reference_pixels:
        raise RequestError(f"{bomb}; this one is {width}x{height}", param=param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            oriented = refs._oriented(refs.decode(image))
    except Image.DecompressionBombError:
        raise RequestError(bomb, param=param) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError):
        raise RequestError(unreadable, param=param) from None
    digest = hashlib.sha256(data if data is not None else oriented.tobytes()).hexdigest()
    return oriented, (image if data is None else data), digest


def _edit_region(mask: Any) -> Any:
    """Boolean array, True where the mask says edit (see the module's rule)."""
    import numpy as np

    mode = mask.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in mask.info):
        alpha = np.asarray(mask.convert("RGBA").getchannel("A"))
        if alpha.min() < 255:
            return alpha == 0
    return np.asarray(refs._to_rgb(mask).convert("L")) >= 128


def _fit(image: Any, res: Resolution, resample: Any) -> Any:
    from PIL import ImageOps

    if image.size == (res.width, res.height):
        return image
    return ImageOps.fit(image, (res.width, res.height), method=resample)


def load_source(settings: Settings, image: Any, mask: Any, shape: Callable[[int, int], Resolution]) -> InpaintSource:
    """Open, check and fit the source (and mask) to the output shape `shape(width, height)` picks for the
    source's size; refusals name `image` or `mask`."""
    import numpy as np
    from PIL import Image

    opened, upload, digest = _open(settings, image, "image", "image")
    rgb = refs._to_rgb(opened)
    width, height = rgb.size
    if min(width, height) < MIN_REFERENCE_SIDE:
        message = f"image is {width}x{height}; each side must be at least {MIN_REFERENCE_SIDE} px"
        raise RequestError(message, param="image")
    if max(width / height, height / width) > refs.MAX_ASPECT:
        message = f"image is {width}x{height}; the aspect ratio must be at most {refs.MAX_ASPECT:g}:1"
        raise RequestError(message, param="image")
    res = shape(width, height)
    fitted = _fit(rgb, res, Image.Resampling.LANCZOS)
    if mask is None:
        return InpaintSource(fitted, None, f"{width}x{height}", digest, 1.0, upload)
    opened_mask, mask_upload, _ = _open(settings, mask, "mask", "mask")
    if opened_mask.size != (width, height):
        w, h = opened_mask.size
        message = f"mask is {w}x{h} but the image is {width}x{height}: the mask must be the image's size"
        raise RequestError(message, param="mask")
    region = Image.fromarray((_edit_region(opened_mask) * 255).astype(np.uint8), "L")
    region = _fit(region, res, Image.Resampling.NEAREST)
    fraction = float(np.asarray(region).mean() / 255.0)
    if fraction == 0.0:
        message = "mask marks nothing to edit: make the pixels to change fully transparent (or white on black)"
        raise RequestError(message, param="mask")
    return InpaintSource(fitted, region, f"{width}x{height}", digest, fraction, upload, mask_upload)


def feathered(mask: Any, feather: int = FEATHER_PX) -> Any:
    """Blend weights in [0, 1] (float array): 0 outside the mask exactly, rising to 1 over `feather` px inside."""
    import numpy as np
    from PIL import ImageFilter

    hard = np.asarray(mask, dtype=np.float32) / 255.0
    if feather <= 0:
        return hard
    inner = mask.filter(ImageFilter.MinFilter(2 * feather + 1)).filter(ImageFilter.GaussianBlur(feather / 2))
    return np.minimum(np.asarray(inner, dtype=np.float32) / 255.0, hard)


def composite(result: Any, source: Any, mask: Any, feather: int = FEATHER_PX) -> Any:
    """The generated image over the source: outside the mask the answer's pixels are the source's."""
    import numpy as np
    from PIL import Image

    if result.size != source.size:
        result = result.resize(source.size, Image.Resampling.LANCZOS)
    alpha = feathered(mask, feather)[..., None]
    out = np.asarray(result.convert("RGB"), dtype=np.float32) * alpha
    out += np.asarray(source, dtype=np.float32) * (1.0 - alpha)
    return Image.fromarray(np.clip(out + 0.5, 0, 255).astype(np.uint8), "RGB")
