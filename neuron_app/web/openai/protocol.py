"""The OpenAI Images API as a protocol: its requests and answers as pydantic models, validated once.

A body is parsed here into an `ImageGenerationRequest` (JSON) or an `ImageEditRequest` (multipart) in one
validation: the wire types, OpenAI's enumerations and ranges, the fields that go together (a stream makes one
`b64_json` image; `output_compression` is for jpeg and webp) and what this server cannot do (a transparent
background, DALL-E's `style`, GIF or SVG) are refused here with a 400 that names the field, in OpenAI's error shape;
a field nobody defined is `unknown_parameter`, as OpenAI answers it. What depends on the served model (the prompt,
the shape, the steps, the seed, the styles, the images) is the engine's one validation (engine/requests.py), which
the routes hand the parsed request over to. The answers are models too, so the document served at
`/v1/openapi.json` (web/openai/openapi.py) is what the server sends. No field is accepted and ignored: each is
honoured, or mapped and echoed (`quality`, `background`, `moderation`, `input_fidelity`), or refused; the table is
in docs/api.md.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator

from neuron_app.engine.records import Usage
from neuron_app.engine.requests import AUTO_SIZE, parse_resolution, size_refusal
from neuron_app.errors import RequestError, unprintable
from neuron_app.web.openai.errors import ApiError

Output = tuple[str, int | None]  # the file's format and compression (engine/output/images.py)
PNG: Output = ("png", None)
MAX_PARTIAL_IMAGES = 3  # OpenAI's range: 0-3
MAX_IDENTIFIER_CHARS = 256
#: `quality` to a share of the served model's `default_steps` (the steps it is tuned for: its best image).
STEP_SHARE = {"low": 0.5, "medium": 0.75, "high": 1.0}
#: What the other values ask, as a level of STEP_SHARE: klein has nothing above its tuned steps to give them.
QUALITY_AS = {"auto": "high", "xhigh": "high", "max": "high", "standard": "high", "hd": "high"}
#: Why a value OpenAI takes is not offered here (said after what the field takes).
WHY_NOT = {
    "background": "transparent is not offered: FLUX.2-klein draws no alpha channel",
    "output_format": "gif and svg are not offered",
}
#: OpenAI fields this server cannot honour, and why (each a 400 naming it).
REFUSED = {
    "style": "style is DALL-E 3's and is not offered here: describe the style in the prompt, or choose a LoRA "
    "style (lora)",
    "complexity": "complexity is not offered here: FLUX.2-klein has no planning stage to spend it on",
    "frame_count": "frame_count needs output_format gif, which is not offered here",
    "frame_duration_ms": "frame_duration_ms needs output_format gif, which is not offered here",
    "svg": "svg needs output_format svg, which is not offered here",
    "markup": "markup is not offered here: send the region to edit as mask",
}


def _whole(value: Any) -> Any:
    """An integral float (4.0, what some JSON clients send) as the whole number it is; anything else as sent."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


WholeNumber = Annotated[int, BeforeValidator(_whole)]
Binary = {"type": "string", "format": "binary"}
LorasSchema = {
    "description": 'LoRA styles combined: [{"name", "scale"}] (or that list as JSON text); an extension',
    "anyOf": [
        {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {
            "name": {"type": "string"}, "scale": {"type": "number"}}, "required": ["name"]}]}},
        {"type": "string"}, {"type": "null"},
    ],
}  # fmt: skip


class ImageRequest(BaseModel):
    """What generations and edits share: OpenAI's fields, then this server's extensions."""

    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str = Field(description="What to draw (the served model's prompt limit applies)")
    model: str | None = Field(None, description="Optional; must be the served model (GET /v1/models)")
    n: WholeNumber | None = Field(None, description="Images to make, 1..max_images; seeds seed, seed+1, ...")
    size: str | None = Field(None, description="WIDTHxHEIGHT, one of the served shapes, or auto")
    quality: Literal["low", "medium", "high", "xhigh", "max", "auto", "standard", "hd"] | None = Field(
        None, description="Steps: low 1/2 and medium 3/4 of default_steps; the rest default_steps (echoed high)"
    )
    background: Literal["opaque", "auto"] | None = Field(
        None, description="opaque or auto, echoed opaque; transparent is refused: klein draws no alpha channel"
    )
    moderation: Literal["low", "auto"] | None = Field(
        None, description="auto: the operator's checks; low only where the server checks nothing"
    )
    output_format: Literal["png", "jpeg", "webp"] | None = Field(None, description="The file format; default png")
    output_compression: int | None = Field(None, ge=0, le=100, description="jpeg and webp only; default 100")
    partial_images: int | None = Field(None, ge=0, le=MAX_PARTIAL_IMAGES, description="With stream=true: 0-3")
    response_format: Literal["b64_json", "url"] | None = Field(None, description="b64_json (default) or url")
    stream: bool | None = Field(None, description="Server-sent events: partial images, then the image")
    user: str | None = Field(None, max_length=MAX_IDENTIFIER_CHARS, description="Recorded per image in usage")
    safety_identifier: str | None = Field(
        None, max_length=MAX_IDENTIFIER_CHARS, description="Takes precedence over user; recorded per image"
    )
    seed: WholeNumber | None = Field(None, description="An extension: the first image's seed (random if absent)")
    num_inference_steps: WholeNumber | None = Field(
        None, description="An extension: denoising steps, 1..max_steps (default: from quality)"
    )
    lora: str | None = Field(None, description="An extension: a configured LoRA style")
    lora_scale: float | None = Field(None, description="An extension: the style's scale")
    loras: Annotated[Any, WithJsonSchema(LorasSchema)] = None
    aspect_ratio: str | None = Field(None, description='An extension (size_policy nearest): "16:9", ...')
    output_megapixels: float | None = Field(None, description="An extension (size_policy nearest)")
    webhook_url: str | None = Field(None, description="An extension: with Prefer: respond-async, POSTed at the end")

    @model_validator(mode="after")
    def _together(self) -> ImageRequest:
        """The fields that go together, before any model work."""
        for name in ("user", "safety_identifier"):  # booked and printed by `usage --users` (row 23)
            bad = unprintable(getattr(self, name) or "")
            if bad is not None:
                raise _invalid(name, f"{name} may not hold control characters or bidirectional overrides "
                               f"(found {bad.encode('unicode_escape').decode('ascii')})")  # fmt: skip
        if self.output_compression is not None and self.output_format in (None, "png"):
            raise _invalid("output_compression", "output_compression applies to jpeg and webp only")
        if self.partial_images and not self.stream:
            raise _invalid("partial_images", "partial_images needs stream=true")
        if self.stream and self.n not in (None, 1):
            raise _invalid("n", "stream=true makes one image: n must be 1")
        if self.stream and self.response_format == "url":
            raise _invalid("response_format", "stream=true sends b64_json images: leave response_format out")
        if self.num_inference_steps is not None and self.quality not in (None, "auto"):
            raise _invalid("quality", "give quality or num_inference_steps, not both (quality sets the steps)")
        return self

    @property
    def partials(self) -> int | None:
        """The partial images of a streamed answer, or None when it is not streamed."""
        return (self.partial_images or 0) if self.stream else None

    @property
    def output(self) -> Output:
        """The file's format and compression (engine/output/images.py)."""
        return self.output_format or "png", self.output_compression

    @property
    def identifier(self) -> str | None:
        """Who the images are for, as OpenAI reads it: a non-empty safety_identifier, else user."""
        return self.safety_identifier or self.user or None

    def steps(self, default_steps: int) -> int:
        """num_inference_steps as sent (the engine checks it), else the quality's share of the default steps."""
        if self.num_inference_steps is not None:
            return self.num_inference_steps
        level = QUALITY_AS.get(self.quality or "auto", self.quality or "high")
        return max(1, math.ceil(default_steps * STEP_SHARE[level]))

    def check_asynchronous(self) -> None:
        """What a job (Prefer: respond-async) cannot carry: a stream, a format other than PNG."""
        if self.stream:
            raise _invalid("stream", "stream=true and 'Prefer: respond-async' do not go together")
        if self.output[0] != "png":
            raise _invalid("output_format", "output_format must be 'png' for a job (Prefer: respond-async)")

    def check_model(self, served: str) -> None:
        if self.model is not None and self.model != served:
            raise ApiError(400, f"model {self.model!r} is not served here; this server serves {served!r}",
                           param="model", code="model_not_found")  # fmt: skip

    def moderation_used(self, checks_anything: bool) -> str:
        """`auto` is the operator's checks (blocked terms, the safety checker); `low` cannot loosen them, so it is
        refused where there is something to loosen, and true (nothing is filtered) where there is not."""
        if self.moderation == "low" and checks_anything:
            raise _invalid("moderation", "moderation 'low' is not offered: this server's operator sets its checks "
                           "(blocked terms, the safety checker); send auto")  # fmt: skip
        return self.moderation or "auto"

    def echo(self, size: str, steps: int, default_steps: int, moderation: str) -> dict[str, Any]:
        """What the answer and every stream event say was used (OpenAI's top-level fields, and this server's)."""
        fields = {"size": size, "quality": quality_of(steps, default_steps), "background": "opaque"}
        fields |= {"output_format": self.output[0], "moderation": moderation}
        return fields | ({"safety_identifier": self.identifier} if self.identifier else {})


class ImageGenerationRequest(ImageRequest):
    """`POST /v1/images/generations`, a JSON body."""


class ImageEditRequest(ImageRequest):
    """`POST /v1/images/edits`, a multipart form: the images as files, every other field as text."""

    model_config = ConfigDict(json_schema_extra=lambda schema: _edit_schema(schema))

    image: Annotated[list[bytes], WithJsonSchema({"anyOf": [Binary, {"type": "array", "items": Binary}]})] = Field(
        description="1..16 images: references, or with mask or strength the image to redraw (also image[])"
    )
    mask: Annotated[bytes | None, WithJsonSchema({"anyOf": [Binary, {"type": "null"}]})] = Field(
        None, description="A PNG the first image's size: transparent where it is redrawn"
    )
    input_fidelity: Literal["high", "low"] | None = Field(
        None, description="Echoed high: every reference is used whole, at its bucket's resolution"
    )
    strength: float | None = Field(None, description="An extension: image-to-image from the first image, 0-1")

    def echo(self, size: str, steps: int, default_steps: int, moderation: str) -> dict[str, Any]:
        return super().echo(size, steps, default_steps, moderation) | {"input_fidelity": "high"}


def _edit_schema(schema: dict[str, Any]) -> None:
    """The SDKs send several images as `image[]`: the same field."""
    schema["properties"]["image[]"] = {"type": "array", "items": Binary, "description": "image, as a list"}
    schema["required"] = [name for name in schema.get("required", []) if name != "image"]
    schema["anyOf"] = [{"required": ["image"]}, {"required": ["image[]"]}]


def quality_of(steps: int, default_steps: int) -> str:
    """The quality level `steps` reach: the highest whose steps they are at least (low below them all)."""
    reached = [level for level, share in STEP_SHARE.items() if steps >= max(1, math.ceil(default_steps * share))]
    return reached[-1] if reached else "low"


# --- answers ---------------------------------------------------------------------------------------------------
class Echo(BaseModel):
    """What every answer says was used, as OpenAI's answers say it (and this server's own)."""

    size: str = Field(description="The delivered WIDTHxHEIGHT")
    quality: Literal["low", "medium", "high"] = Field(description="The level the steps used reach")
    background: Literal["opaque"] = Field(description="Always opaque: klein draws no alpha")
    output_format: Literal["png", "jpeg", "webp"]
    moderation: Literal["low", "auto"] | None = None
    safety_identifier: str | None = None
    input_fidelity: Literal["high"] | None = Field(None, description="Edits only")


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = Field(None, description="/v1/images/files/<random name>, for image_url_ttl_s")
    revised_prompt: str | None = None
    provenance: dict[str, Any] = Field(description="How it was made: seed, resolution, cache, seconds, marks")


class ImagesResponse(Echo):
    """The answer of a request that is neither streamed nor a job."""

    created: int
    data: list[ImageData]
    usage: Usage
    revised_size: str | None = Field(None, description="size_policy nearest: the served shape it was made at")
    info: dict[str, Any] | None = None


class ImagePartialEvent(Echo):
    type: Literal["image_generation.partial_image", "image_edit.partial_image"]
    b64_json: str
    partial_image_index: int
    created_at: int


class ImageCompletedEvent(Echo):
    type: Literal["image_generation.completed", "image_edit.completed"]
    b64_json: str
    created_at: int
    usage: Usage
    provenance: dict[str, Any]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ErrorEvent(BaseModel):
    """A failure after the stream began (the SDKs raise it as an APIError)."""

    type: Literal["error"]
    error: ErrorBody


class ImageJob(BaseModel):
    """The 202 of `Prefer: respond-async`, and `GET /v1/images/jobs/{id}`; ended, it has the answer's fields."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["image.job"]
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    created: int
    size: str
    n: int
    queue_position: int | None = None
    queue_eta_s: float | None = None


def answer(model: type[BaseModel], **fields: Any) -> dict[str, Any]:
    """An answer built through its model (what the document says is what is sent), as JSON-ready data."""
    return model(**fields).model_dump(mode="json", exclude_unset=True)


# --- parsing ---------------------------------------------------------------------------------------------------
def parse_json(body: bytes) -> ImageGenerationRequest:
    """A generations body, validated once; every refusal an ApiError (400) naming the field."""
    try:
        fields = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    except RecursionError:  # 200 000 nested brackets: Python's parser gives up, the answer stays clear
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(fields, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return validated(ImageGenerationRequest, fields)


def parse_form(texts: dict[str, str], images: list[bytes], mask: Any) -> ImageEditRequest:
    """An edits form: its text fields typed as the model declares them (a number where it takes one, true/false
    where a flag), then validated once like a JSON body."""
    kinds = _kinds(ImageEditRequest)
    fields: dict[str, Any] = {key: _typed(value, kinds.get(key, set())) for key, value in texts.items()}
    return validated(ImageEditRequest, fields | {"image": images, "mask": mask})


def validated(model: type[ImageRequest], fields: dict[str, Any]) -> Any:
    for name, reason in REFUSED.items():
        if fields.get(name) is not None:
            raise _invalid(name, reason, code="unsupported_parameter")
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise _refusal(model, exc.errors()[0]) from None


def check_size(size: Any, offered: list[str]) -> None:
    """Every `size` refusal names `size` and lists the offered shapes: the engine refuses 1000x1000 for its width
    (not a multiple of 16) before it would say which sizes there are."""
    if size == AUTO_SIZE or (isinstance(size, str) and size in offered):
        return
    try:
        reason = f"resolution {parse_resolution(size, 'size')} is not offered"
    except RequestError as exc:
        reason = str(exc)
    raise RequestError(size_refusal(reason, offered), param="size")


def _invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _refusal(model: type[ImageRequest], error: Any) -> ApiError:
    """Pydantic's first error as OpenAI's: the field, what it takes, and a code."""
    name = str(error["loc"][0]) if error["loc"] else "body"
    if error["type"] == "extra_forbidden":
        return _invalid(name, f"Unknown parameter: {name!r}", code="unknown_parameter")
    if error["type"] == "missing":
        return _invalid(name, f"{name} is required", code="missing_required_parameter")
    why = f" ({WHY_NOT[name]})" if name in WHY_NOT else ""
    return _invalid(name, f"{name} must be {_expected(_properties(model).get(name, {}))}{why}")


def _expected(schema: dict[str, Any]) -> str:
    """What a field takes, in words, from its JSON schema."""
    options = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    first = options[0] if options else {}
    if "enum" in first:
        return "one of " + ", ".join(map(str, first["enum"]))
    if first.get("type") == "integer":
        low, high = first.get("minimum"), first.get("maximum")
        return f"a whole number from {low} to {high}" if low is not None else "a whole number"
    if first.get("type") == "string" and "maxLength" in first:
        return f"text of at most {first['maxLength']} characters"
    words = {"number": "a number", "boolean": "true or false", "string": "text", "array": "a list of files"}
    return words.get(str(first.get("type")), "valid")


@functools.cache
def _properties(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema()["properties"]


def _kinds(model: type[BaseModel]) -> dict[str, set[str]]:
    """Each field's JSON types (integer, number, boolean, string, ...)."""
    properties = _properties(model)
    return {name: {s.get("type", "") for s in spec.get("anyOf", [spec])} for name, spec in properties.items()}


def _typed(value: str, kinds: set[str]) -> Any:
    """A form's text as the field's type; left as sent when it is not one (the validation then says so)."""
    text = value.strip()
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kinds & {"integer", "number"}:
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return _whole(float(text)) if "integer" in kinds else float(text)
        except ValueError:
            return value
    return value
