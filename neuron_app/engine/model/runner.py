"""One pipeline call, described as data so that tensor-parallel followers can replay it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from neuron_app import tracing
from neuron_app.engine.modes import img2img
from neuron_app.engine.modes.masks import composite
from neuron_app.engine.modes.previews import latent_preview

StepCallback = Callable[[int, int, Any], None]  # step, total, preview image (None unless `previews`)


@dataclass(frozen=True)
class PipelineCall:
    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    output_type: str = "pil"
    loras: tuple[tuple[str, float], ...] = ()  # the LoRA styles for the adapter slots (engine/modes/lora.py)
    references: tuple[Any, ...] = ()  # RGB PIL images already at their bucket size (an edit)
    init_image: Any = None  # image-to-image / inpaint: the RGB source at width x height (engine/modes/img2img.py)
    mask: Any = None  # inpaint: "L" at width x height, 255 = edit; the answer is composited over the source
    strength: float = 1.0  # image-to-image: the share of the schedule run from the noised source
    previews: bool = False  # a host-side preview of the latents after each step (engine/modes/previews.py)


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
    `prompt_cache` (engine/cache/prompt_cache.py) a prompt seen before skips the text encoder.
    """
    import torch

    generator = torch.Generator(device="cpu").manual_seed(call.seed)
    start: Any = None
    total = call.steps
    spans: dict[str, Any] = {}  # the denoising loop, then the decode (tracing.py; None while off)

    def step_end(_pipe: Any, step: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if start is not None:
            kwargs["latents"] = start.blend(step, kwargs["latents"])
        if step + 1 == total:  # the loop's last step: what follows in the pipeline is the VAE decode
            tracing.end(spans.pop("denoise", None), steps=total)
            spans["decode"] = tracing.start("decode")
        if on_step is not None:
            preview = None
            if call.previews:
                preview = latent_preview(kwargs["latents"], call.width, call.height, getattr(pipe, "preview_rgb", None))
            on_step(step + 1, total, preview)
        return kwargs

    with torch.inference_mode():
        extra: dict[str, Any] = {}
        if call.init_image is not None:
            start = img2img.prepare(pipe, call.init_image, call.mask, call.strength, call.steps, generator)
            extra, total = {"latents": start.latents, "sigmas": start.sigmas}, start.steps_run
        embeds = None if prompt_cache is None else prompt_cache.embeds(pipe, call.prompt, max_sequence_length)
        text = {"prompt": call.prompt} if embeds is None else {"prompt_embeds": embeds}
        spans["denoise"] = tracing.start("denoise", steps=total)
        try:
            out = pipe(
                **extra,
                **text,
                image=list(call.references) or None,
                width=call.width,
                height=call.height,
                num_inference_steps=call.steps,
                guidance_scale=guidance_scale,
                max_sequence_length=max_sequence_length,
                generator=generator,
                output_type=call.output_type,
                callback_on_step_end=step_end,
            )
        finally:  # a cancel (engine/steps.py) or an error ends them too
            for name in list(spans):
                tracing.end(spans.pop(name))
    image = out.images[0]
    if call.mask is not None and call.output_type == "pil":
        image = composite(image, call.init_image, call.mask)  # outside the mask: the source's pixels
    return image


class Lockstep(Protocol):
    """Tensor-parallel coordination: followers replay every pipeline call of rank 0."""

    #: Why the group can no longer be used (a rank died or timed out); None while it is whole.
    broken: str | None

    def before(self, call: PipelineCall) -> None: ...

    def after(self, error: BaseException | None) -> BaseException | None: ...
