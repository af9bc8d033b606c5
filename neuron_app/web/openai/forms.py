"""The edits endpoint's multipart form as it arrives: read within its byte budget and parsed, its images handed to the
protocol (web/openai/protocol.py) with its text fields, and the request's images as the manager's options
(references, or an inpaint's source and mask)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from neuron_app.web.openai.errors import ApiError, read_body
from neuron_app.web.openai.protocol import ImageEditRequest, parse_form

EDIT_BODY_LIMIT = 50 << 20
MAX_EDIT_IMAGES = 16


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def read_edit_form(request: Request) -> ImageEditRequest:
    """The form, validated once by the protocol; an ApiError when malformed. The body streams into Starlette's
    parser as it arrives (file parts spooled to disk past 1 MB, the body never held whole), counted against
    EDIT_BODY_LIMIT; each image is then read once."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > EDIT_BODY_LIMIT:
        await read_body(request, EDIT_BODY_LIMIT)  # raises 413
    if content_type(request) != "multipart/form-data":
        raise ApiError(400, "Content-Type must be multipart/form-data", code="invalid_content_type")
    over = [False]
    too_large = f"the request body is larger than {EDIT_BODY_LIMIT} bytes"

    async def chunks() -> AsyncIterator[bytes]:  # past the limit it stops: the parser then closes what it spooled
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > EDIT_BODY_LIMIT:
                over[0] = True
                return
            yield chunk

    parser = MultiPartParser(request.headers, chunks(), max_files=MAX_EDIT_IMAGES + 1, max_fields=64)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        if over[0]:
            raise ApiError(413, too_large, code="request_too_large") from None
        raise ApiError(400, f"the multipart body is not valid: {exc.message}", code="invalid_multipart") from exc
    try:
        if over[0]:
            raise ApiError(413, too_large, code="request_too_large")
        uploads = [v for key in ("image", "image[]") for v in form.getlist(key) if isinstance(v, UploadFile)]
        if not uploads:
            raise ApiError(400, "image is required: one or more image files", param="image")
        if len(uploads) > MAX_EDIT_IMAGES:
            raise ApiError(400, f"at most {MAX_EDIT_IMAGES} images", param="image")
        mask = form.get("mask")
        if mask is not None and not isinstance(mask, UploadFile):
            raise ApiError(400, "mask must be a PNG file the image's size", param="mask")
        images = [await upload.read() for upload in uploads]
        texts = {key: value for key, value in form.items() if isinstance(value, str) and key != "mask"}
        return parse_form(texts, images, None if mask is None else await mask.read())
    finally:
        await form.close()  # the spooled files


def image_options(edit: ImageEditRequest) -> dict[str, Any]:
    """OpenAI's `mask` (transparent = edit) applies to the first image; `strength` (an extension) without a
    mask makes it image-to-image. The other images are references. Without either, all are references."""
    if edit.mask is None and edit.strength is None:
        return {"references": edit.image}
    options: dict[str, Any] = {"image": edit.image[0], "references": edit.image[1:] or None, "strength": edit.strength}
    if edit.mask is not None:
        options["mask"] = edit.mask
    return options
