"""Image-to-image and mask inpainting on the text-to-image graph.

diffusers' `Flux2KleinInpaintPipeline` does three things beyond text-to-image: it starts from the source's
latents noised to the first kept step (`strength` drops the first steps of the schedule), after every step it
puts the source's latents, noised to the next step's level, back outside the mask, and it appends the source's
latents to the transformer's input as a reference (twice the image tokens: another graph, a new compile on
Neuron). This module does the first two, exactly as that pipeline does, through the loaded `Flux2KleinPipeline`
(`latents=`, `sigmas=`, `callback_on_step_end`): the transformer sees the text-to-image tokens (or an edit's,
with references), so a shape compiled for text-to-image serves inpainting with no new graph, and no second
pipeline object or copy of the weights exists. The source still guides the masked region: the transformer
attends to its (noised) tokens outside the mask at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Img2Img:
    """What the pipeline call gets (`latents`, `sigmas`) and the per-step blend outside the mask."""

    latents: Any  # (1, 4C, H/16, W/16): the source noised to the first kept step
    sigmas: list[float]  # the kept tail of the schedule, before the scheduler's shift
    steps_run: int
    shifted: Any  # the scheduler's sigmas after the shift: kept steps + the final 0
    noise: Any  # packed (1, tokens, 4C)
    source: Any  # packed source latents
    keep: Any  # packed (1, tokens, 1): 1 where the source is kept, None for image-to-image

    def blend(self, step: int, latents: Any) -> Any:
        """After kept step `step` (0-based): the source at the next noise level outside the mask."""
        if self.keep is None:
            return latents
        sigma = self.shifted[step + 1]
        reference = sigma * self.noise + (1.0 - sigma) * self.source
        return self.keep * reference.to(latents.dtype) + (1.0 - self.keep) * latents


def kept_steps(steps: int, strength: float) -> int:
    """How many of `steps` an image-to-image at `strength` runs (diffusers' `get_timesteps` rule)."""
    start = int(max(steps - min(steps * strength, steps), 0))
    return steps - start


def prepare(pipe: Any, image: Any, mask: Any, strength: float, steps: int, generator: Any) -> Img2Img:
    """Encode the source, pick the kept schedule and noise it, as `Flux2KleinInpaintPipeline` would."""
    import numpy as np
    import torch
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    from diffusers.utils.torch_utils import get_module_execution_device, randn_tensor

    from neuron_app.crossing import to_core

    width, height = image.size
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    rows, cols = height // (pipe.vae_scale_factor * 2), width // (pipe.vae_scale_factor * 2)
    tensor = pipe.image_processor.preprocess(image, height=height, width=width)
    tensor = tensor.to(device=get_module_execution_device(pipe.vae), dtype=pipe.vae.dtype)
    source = pipe._encode_vae_image(tensor, generator)  # argmax: no randomness
    source = to_core(source, device, dtype)  # from the VAE's core, through the host
    shape = (1, pipe.transformer.config.in_channels, rows, cols)
    noise = randn_tensor(shape, generator=generator, device=device, dtype=dtype)  # as the pipeline draws it
    full = np.linspace(1.0, 1 / steps, steps)
    run = kept_steps(steps, strength)
    sigmas = [float(s) for s in full[steps - run :]]
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)  # a copy: the shifted values only
    scheduler.set_timesteps(sigmas=sigmas, device="cpu", mu=compute_empirical_mu(rows * cols, steps))
    shifted = [float(s) for s in scheduler.sigmas]
    first = shifted[0]
    latents = noise if first == 1.0 else first * noise + (1.0 - first) * source
    keep = None
    if mask is not None:
        edit = torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)[None, None]
        edit = torch.nn.functional.interpolate(edit, size=(rows, cols), mode="area")  # share of each token edited
        keep = pipe._pack_latents(1.0 - edit).to(device=device, dtype=dtype)
    packed_noise, packed_source = pipe._pack_latents(noise), pipe._pack_latents(source)
    return Img2Img(latents, sigmas, run, shifted, packed_noise, packed_source, keep)
