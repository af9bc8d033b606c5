"""One pipeline call, described as data so that tensor-parallel followers can replay it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

StepCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class PipelineCall:
    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    output_type: str = "pil"
    lora: str = "none"  # the LoRA style in the adapter slot for this call (engine/lora.py)
    lora_scale: float = 1.0
    references: tuple[Any, ...] = ()  # RGB PIL images already at their bucket size (an edit)


def run_call(
    pipe: Any,
    call: PipelineCall,
    *,
    guidance_scale: float,
    max_sequence_length: int,
    on_step: StepCallback | None = None,
    prompt_cache: Any = None,
) -> Any:
    """Run the pipeline once; returns the first image (or latents).

    The generator lives on the CPU so that a seed gives the same image on every device. With a
    `prompt_cache` (engine/prompt_cache.py) a prompt seen before skips the text encoder.
    """
    import torch

    def step_end(_pipe: Any, step: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if on_step is not None:
            on_step(step + 1, call.steps)
        return kwargs

    with torch.inference_mode():
        embeds = None if prompt_cache is None else prompt_cache.embeds(pipe, call.prompt, max_sequence_length)
        text = {"prompt": call.prompt} if embeds is None else {"prompt_embeds": embeds}
        out = pipe(
            **text,
            image=list(call.references) or None,
            width=call.width,
            height=call.height,
            num_inference_steps=call.steps,
            guidance_scale=guidance_scale,
            max_sequence_length=max_sequence_length,
            generator=torch.Generator(device="cpu").manual_seed(call.seed),
            output_type=call.output_type,
            callback_on_step_end=step_end,
        )
    return out.images[0]


class Lockstep(Protocol):
    """Tensor-parallel coordination: followers replay every pipeline call of rank 0."""

    #: Why the group can no longer be used (a rank died or timed out); None while it is whole.
    broken: str | None

    def before(self, call: PipelineCall) -> None: ...

    def after(self, error: BaseException | None) -> BaseException | None: ...
