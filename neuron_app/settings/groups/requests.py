"""What a request may ask for: the served shapes, steps, prompt length, the page's examples."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from neuron_app.errors import ShapeError
from neuron_app.shapes import Resolution


class RequestSettings(BaseModel):
    """The shapes served (each a compile on Neuron), the steps and the prompts a request may carry."""

    resolutions: list[str] = Field(
        ["1024x1024", "1152x1024", "1024x1152", "1536x768", "768x1536", "1024x896", "896x1024"],
        description="The only shapes served, as WIDTHxHEIGHT, multiples of 16 (each is a compile on Neuron). The "
        "defaults' image tokens are multiples of 512, so with 512 text tokens every one takes Neuron's NKI "
        "attention kernel.",
    )

    default_resolution: str = Field("1024x1024", description="Shape preselected in the UI; must be listed.")

    default_steps: int = Field(4, ge=1, description="Steps preselected in the UI (klein is step-distilled: 4).")

    max_steps: int = Field(16, ge=1, le=200, description="Largest step count a request may ask for.")

    max_prompt_chars: int = Field(2000, ge=1, description="Longer prompts are refused before any model work.")

    example_prompts: list[str] = Field(
        [
            "A lighthouse on a cliff at dawn, volumetric light, 35mm photo",
            "A watercolor fox reading a book under a cherry tree",
            "Isometric cutaway of a tiny robot workshop, soft pastel colors",
        ],
        description="Prompts the page offers as examples (tiny-shapes offers prompts of its grammar).",
    )

    prompt_placeholder: str = Field(
        "Describe the image, press Enter",
        description="What the empty prompt box says (tiny-shapes: its grammar, in the word order it reads).",
    )

    @field_validator("resolutions")
    @classmethod
    def _check_resolutions(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one resolution is needed")
        for text in value:
            try:
                Resolution.parse(text)
            except ShapeError as exc:
                raise ValueError(str(exc)) from None
        if len(set(value)) != len(value):
            raise ValueError("resolutions are listed more than once")
        return value

    @property
    def parsed_resolutions(self) -> list[Resolution]:
        return [Resolution.parse(r) for r in self.resolutions]
