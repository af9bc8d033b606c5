"""Reference images for editing: a safe upload, normalized to a compiled bucket before the pipeline sees it.

FLUX.2-klein concatenates each reference's tokens after the output's, so an arbitrary upload would be a new
sequence length, a new compile on Neuron. Every reference is therefore opened safely (a pixel limit checked
from the header, before decoding), oriented (EXIF), made RGB, checked like the pipeline checks it (>= 64 px a
side, aspect <= 8:1), then resized to cover and center-cropped to the bucket of `reference_resolutions` with
the nearest aspect ratio. Buckets are multiples of 16 and at most 1024x1024 in area, so the pipeline leaves
them unchanged and the graph depends only on the output shape and the buckets.

Accepted sources: raw bytes, a file path, a PIL image, a Gradio file dict ({"path": ...}) or a Gallery item
((path, caption)). Every refusal is a `RequestError` naming the limit.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_app.errors import RequestError
from neuron_app.settings import MIN_REFERENCE_SIDE, Settings
from neuron_app.shapes import Resolution

#: The pipeline refuses references more elongated than this (diffusers' `check_image_input`).
MAX_ASPECT = 8.0
_MB = 1024 * 1024


def _error(message: str) -> RequestError:
    """A refusal about the reference images (OpenAI's `image`)."""
    return RequestError(message, param="references")


@dataclass(frozen=True)
class Reference:
    """One normalized reference: `image` is RGB at `bucket` size; `size` is the upload as oriented; `upload` is
    what was uploaded (its bytes, or the PIL image given), what a replica on another machine decodes again."""

    image: Any
    size: str
    bucket: Resolution
    sha256: str
    upload: Any = field(default=None, repr=False, compare=False)

    def info(self) -> dict[str, str]:
        return {"size": self.size, "bucket": str(self.bucket), "sha256": self.sha256}


def nearest(width: int, height: int, shapes: Sequence[Resolution]) -> Resolution:
    """The shape nearest in aspect ratio (log distance); ties go to the nearer area, then to list order."""
    aspect, area = math.log(width / height), math.log(width * height)

    def distance(index: int) -> tuple[float, float, int]:
        s = shapes[index]
        return (round(abs(math.log(s.width / s.height) - aspect), 9), abs(math.log(s.width * s.height) - area), index)

    return shapes[min(range(len(shapes)), key=distance)]


def auto_resolution(first: Reference, offered: Sequence[str]) -> Resolution:
    """`resolution="auto"`: the offered output shape nearest in aspect ratio to the first reference as uploaded."""
    width, height = (int(v) for v in first.size.split("x"))
    return nearest(width, height, [Resolution.parse(name) for name in offered])


def check_references(settings: Settings, references: Sequence[Any] | None) -> tuple[Reference, ...]:
    """None = text-to-image; a sequence = an edit with 1..max_references images, each normalized to its bucket."""
    if references is None:
        return ()
    if isinstance(references, (str, bytes, bytearray, os.PathLike, dict)) or not isinstance(references, Sequence):
        references = [references]  # one reference given bare
    limit = settings.max_references
    if limit == 0:
        raise _error("image editing is disabled on this server (max_references = 0)")
    if not settings.parsed_reference_resolutions:
        raise _error(
            "image editing needs reference buckets: no served resolution is at least 64 px a side and at most "
            "1024x1024 in area; set reference_resolutions"
        )
    if not references:
        raise _error("an edit needs at least one reference image")
    if len(references) > limit:
        raise _error(f"{len(references)} reference images given; the limit is {limit}")
    for i, source in enumerate(references):  # every header first: no image is decoded if any one is too big
        _header(settings, source, f"reference image {i + 1}")
    return tuple(load_reference(settings, source, i + 1) for i, source in enumerate(references))


def _read_source(settings: Settings, source: Any, label: str) -> tuple[bytes | None, Any]:
    """The upload's bytes (None for a PIL image, returned second), with the size limit checked first."""
    limit = settings.max_upload_mb * _MB
    if isinstance(source, tuple) and source:  # a Gallery item: (path, caption)
        source = source[0]
    if isinstance(source, dict):  # a Gradio FileData dict
        source = source.get("path")
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            size = path.stat().st_size
            if not path.is_file():
                raise _error(f"{label} is not a file")
            if size > limit:
                raise _error(f"{label} is {size / _MB:.1f} MB; the limit is {settings.max_upload_mb:g} MB")
            data = path.read_bytes()
        except OSError:
            raise _error(f"{label} could not be read (no such file)") from None
    elif type(source).__module__.startswith("PIL."):
        return None, source
    else:
        raise _error(f"{label} must be an image file, bytes or a PIL image, got {type(source).__name__}")
    if len(data) > limit:
        raise _error(f"{label} is {len(data) / _MB:.1f} MB; the limit is {settings.max_upload_mb:g} MB")
    return data, None


def _header(settings: Settings, source: Any, label: str) -> tuple[bytes | None, Any]:
    """The upload's bytes and its image opened from the header only, refused above `max_reference_pixels`:
    a small file that declares a huge image costs a header read, never a decode."""
    from PIL import Image, UnidentifiedImageError

    data, image = _read_source(settings, source, label)
    bomb = f"{label} has too many pixels; the limit is {settings.max_reference_pixels:,} (width x height)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own, lower limit decides
            if image is None:
                image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise _error(bomb) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError):
        raise _error(f"{label} is not a readable image (unknown format, truncated or corrupt)") from None
    width, height = image.size
    if width * height > settings.max_reference_pixels:
        raise _error(f"{bomb}; this one is {width}x{height}")
    return data, image


def decode(image: Any) -> Any:
    """Decode an opened image's pixels (its first frame): the costly step, after every header check."""
    image.seek(0)  # animations: the first frame
    image.load()
    return image


def load_reference(settings: Settings, source: Any, index: int = 1) -> Reference:
    """Open, check and normalize one reference; refusals name the limit."""
    from PIL import Image

    label = f"reference image {index}"
    data, image = _header(settings, source, label)
    upload = image if data is None else data
    unreadable = f"{label} is not a readable image (unknown format, truncated or corrupt)"
    bomb = f"{label} has too many pixels; the limit is {settings.max_reference_pixels:,} (width x height)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            rgb = _to_rgb(_oriented(decode(image)))
    except Image.DecompressionBombError:
        raise _error(bomb) from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError):
        raise _error(unreadable) from None
    width, height = rgb.size
    if min(width, height) < MIN_REFERENCE_SIDE:
        raise _error(f"{label} is {width}x{height}; each side must be at least {MIN_REFERENCE_SIDE} px")
    if max(width / height, height / width) > MAX_ASPECT:
        raise _error(f"{label} is {width}x{height}; the aspect ratio must be at most {MAX_ASPECT:g}:1")
    bucket = nearest(width, height, settings.parsed_reference_resolutions)
    digest = hashlib.sha256(data if data is not None else rgb.tobytes()).hexdigest()
    return Reference(_fit(rgb, bucket), f"{width}x{height}", bucket, digest, upload)


def _oriented(image: Any) -> Any:
    """Apply the EXIF orientation; a broken EXIF block leaves the image as stored."""
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(image)
    except Exception:
        return image


def _to_rgb(image: Any) -> Any:
    """RGB 8-bit: alpha composited on white; palette, CMYK, grayscale, 16-bit and float images converted."""
    import numpy as np
    from PIL import Image

    mode = image.mode
    if mode.startswith("I") or mode == "F":  # 16/32-bit integer or float grayscale
        values = np.asarray(image, dtype=np.float64)
        top = (
            1.0
            if mode == "F" and values.max(initial=0) <= 1.0
            else (255.0 if values.max(initial=0) <= 255 else 65535.0)
        )
        image = Image.fromarray(np.clip(values / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
        mode = "L"
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in image.info)
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if mode == "RGB" else image.convert("RGB")


def _fit(image: Any, bucket: Resolution) -> Any:
    """Resize to cover the bucket and center-crop: the pipeline then leaves the reference unchanged."""
    from PIL import Image, ImageOps

    if image.size == (bucket.width, bucket.height):
        return image
    return ImageOps.fit(image, (bucket.width, bucket.height), method=Image.Resampling.LANCZOS)
