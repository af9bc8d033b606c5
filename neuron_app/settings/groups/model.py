"""What is served: the pipeline, its weights' dtype, the prompt length; the shipped models' defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr

TINY = "tiny"

#: Models trained here that ship in the repository (neuron_app/models/NAME, docs/tiny-shapes.md).
SHIPPED_MODELS = Path(__file__).resolve().parents[2] / "models"


def shipped_model(name: str) -> Path:
    return SHIPPED_MODELS / name


#: What a shipped model serves when the settings leave these at their defaults (the 4B's).
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny-shapes": {
        "resolutions": ["128x128", "256x256", "256x128", "128x256"],
        "default_resolution": "128x128",
        "max_sequence_length": 32,
        "example_prompts": [
            "a purple circle on a yellow background",
            "a red square on a blue background on the left",
            "a large green triangle on a white background",
            "a small yellow circle on a black background at the top",
        ],
        # The order it was trained on: with the position before the background, the background comes out wrong.
        "prompt_placeholder": "a [small|large] {colour} {shape} on a {colour} background [on the left|right, at the "
        "top|bottom], Enter",
    }
}


class ModelSettings(BaseModel):
    """The pipeline and how it is called: which model, its revision and dtype, the prompt tokens, guidance."""

    model: str = Field(
        "black-forest-labs/FLUX.2-klein-4B",
        description="Hub id or local folder of a Flux2KleinPipeline; 'tiny-shapes' for the small model trained on "
        "coloured shapes that ships here (docs/tiny-shapes.md); 'tiny' for the offline random test model.",
    )

    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of `model`.")

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weights dtype; auto = bfloat16 on neuron/cuda, float32 on cpu."
    )

    hf_token: SecretStr | None = Field(
        None, description="Hub token for gated models (environment only: NEURON_APP_HF_TOKEN)."
    )

    max_sequence_length: int = Field(
        512, ge=8, le=2048, description="Prompt tokens; prompts are padded to it, changing it recompiles."
    )

    guidance_scale: float = Field(
        1.0, ge=0.0, le=30.0, description="Guidance scale; ignored by the distilled klein models."
    )

    @property
    def is_tiny(self) -> bool:
        return self.model == TINY
