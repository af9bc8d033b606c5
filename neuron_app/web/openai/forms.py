"""What an Images API request's fields ask beyond the prompt: the edits endpoint's multipart form (read within its
byte budget, its fields as numbers where they are numbers, its images as references or an inpaint's source and
mask), and the answer's file format (`output_format`, `output_compression`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from neuron_app.web.openai.errors import ApiError, read_body

EDIT_BODY_LIMIT = 50 << 20
MAX_EDIT_IMAGES = 16
OUTPUT_FORMATS = ("png", "jpeg", "webp")
Output = tuple[str, int | None]
PNG: Output = ("png", None)


def output_choice(fields: dict[str, Any]) -> Output:
    """OpenAI's `output_format` (png, jpeg, webp; default png) and `output_compression` (0-100, jpeg and webp only;
    default 100), checked before any model work."""
    fmt = fields.get("output_format") or "png"
    if fmt not in OUTPUT_FORMATS:
        raise ApiError(400, f"output_format must be one of {', '.join(OUTPUT_FORMATS)}", param="output_format",
                       code="invalid_value")  # fmt: skip
    level = fields.get("output_compression")
    if level is None:
        return fmt, None
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 100:
        raise ApiError(400, "output_compression must be a whole number from 0 to 100", param="output_compression",
                       code="invalid_value")  # fmt: skip
    if fmt == "png":
        raise ApiError(400, "output_compression applies to jpeg and webp only", param="output_compression",
                       code="invalid_value")  # fmt: skip
    return fmt, level


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _form_value(value: Any) -> Any:
    """Multipart fields arrive as text: numbers become numbers, the rest stays as sent (and is validated)."""
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(value)
    return value


async def read_edit_form(request: Request) -> tuple[dict[str, Any], dict[str, Any]]:
    """The form's fields and the manager's options of its images (`inpaint_options`); an ApiError when malformed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > EDIT_BODY_LIMIT:
        await read_body(request, EDIT_BODY_LIMIT)  # raises 413
    if content_type(request) != "multipart/form-data":
        raise ApiError(400, "Content-Type must be multipart/form-data", code="invalid_content_type")
    body = await read_body(request, EDIT_BODY_LIMIT)

    async def chunks() -> AsyncIterator[bytes]:
        yield body

    parser = MultiPartParser(request.headers, chunks(), max_files=MAX_EDIT_IMAGES, max_fields=64)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise ApiError(400, f"the multipart body is not valid: {exc.message}", code="invalid_multipart") from exc
    uploads = [v for key in ("image", "image[]") for v in form.getlist(key) if isinstance(v, UploadFile)]
    if not uploads:
        raise ApiError(400, "image is required: one or more image files", param="image")
    if len(uploads) > MAX_EDIT_IMAGES:
        raise ApiError(400, f"at most {MAX_EDIT_IMAGES} images", param="image")
    images = [await upload.read() for upload in uploads]
    fields = {key: _form_value(value) for key, value in form.items() if isinstance(value, str)}
    fields["prompt"] = form.get("prompt")  # text stays text
    options = await inpaint_options(form, fields, images)
    return fields, options


async def inpaint_options(form: Any, fields: dict[str, Any], images: list[bytes]) -> dict[str, Any]:
    """OpenAI's `mask` (transparent = edit) applies to the first image; `strength` (an extension) without a
    mask makes it image-to-image. The other images are references. Without either, all are references."""
    mask = form.get("mask")
    if mask is not None and not isinstance(mask, UploadFile):
        raise ApiError(400, "mask must be a PNG file the image's size", param="mask")
    strength = fields.get("strength")
    if mask is None and strength is None:
        return {"references": images}
    options: dict[str, Any] = {"image": images[0], "references": images[1:] or None, "strength": strength}
    if mask is not None:
        options["mask"] = await mask.read()
    return options
