"""The extra modes: editing with references, LoRA styles, live previews."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from neuron_app.errors import ShapeError
from neuron_app.shapes import Resolution

#: References are resized to buckets the pipeline leaves as they are: at most 1024x1024 in area, 64 px a side.
MAX_REFERENCE_AREA = 1024 * 1024

MIN_REFERENCE_SIDE = 64


class ModeSettings(BaseModel):
    """References (how many, their buckets, upload sizes), LoRA styles and their limits, step previews."""

    max_references: int = Field(4, ge=0, le=16, description="Reference images an edit may carry; 0 turns editing off.")

    reference_resolutions: list[str] = Field(
        [],
        description="Buckets every reference is resized and center-cropped to (nearest aspect ratio), as WIDTHxHEIGHT, "
        "multiples of 16, at most 1024x1024 in area; empty = the served resolutions up to that area.",
    )

    max_upload_mb: float = Field(
        20.0,
        gt=0,
        le=1024,
        description="Largest uploaded file, in MB (Gradio's max_file_size; also checked per reference).",
    )

    max_reference_pixels: int = Field(
        50_000_000,
        ge=4096,
        le=178_956_970,  # Pillow's own hard limit (2 x Image.MAX_IMAGE_PIXELS): beyond it Pillow refuses anyway
        description="Largest reference image in pixels (width x height), checked before decoding: "
        "decompression bombs are refused.",
    )

    @field_validator("reference_resolutions")
    @classmethod
    def _check_reference_resolutions(cls, value: list[str]) -> list[str]:
        for text in value:
            try:
                res = Resolution.parse(text)
            except ShapeError as exc:
                raise ValueError(str(exc)) from None
            if res.width * res.height > MAX_REFERENCE_AREA or min(res.width, res.height) < MIN_REFERENCE_SIDE:
                raise ValueError(
                    f"reference resolution {res} must be at most {MAX_REFERENCE_AREA} pixels in area "
                    f"and at least {MIN_REFERENCE_SIDE} px a side (the pipeline would resize it otherwise)"
                )
        return value

    loras: dict[str, str] = Field(
        {},
        description="LoRA styles offered per request, name -> source: a .safetensors file, a folder "
        "(folder:weight.safetensors), a Hub id (owner/repo:weight.safetensors), or tiny:<seed> (a random "
        "LoRA for the tiny model). Switched in place without recompiling.",
    )

    max_lora_rank: int = Field(
        64, ge=1, le=1024, description="Hotswap target rank: every adapter is padded to it; higher ranks are refused."
    )

    max_lora_scale: float = Field(2.0, gt=0.0, le=100.0, description="Largest LoRA scale a request may ask for.")

    max_loras_per_request: int = Field(
        3,
        ge=1,
        le=8,
        description="Most LoRA styles one request may combine: one compiled slot each (at most the number of loras).",
    )

    previews: bool = Field(
        True, description="The page shows a host-side preview of the latents after each step (no VAE, no compile)."
    )

    @property
    def parsed_reference_resolutions(self) -> list[Resolution]:
        """The reference buckets: the configured ones, else the served shapes the pipeline leaves unchanged."""
        if self.reference_resolutions:
            return [Resolution.parse(r) for r in self.reference_resolutions]
        return [
            r
            for r in self.parsed_resolutions
            if r.width * r.height <= MAX_REFERENCE_AREA and min(r.width, r.height) >= MIN_REFERENCE_SIDE
        ]
