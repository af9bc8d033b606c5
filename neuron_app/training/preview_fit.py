"""The live previews' latent-to-RGB map for a model trained here, fitted to its own VAE and shipped beside it.

FLUX.2's published factors (engine/modes/previews.py) describe FLUX.2's latent space, not this VAE's, so the
previews of `tiny-shapes` showed other colours than its images. Here: rendered scenes at several sizes, encoded
and normalised as the transformer sees them, against what the VAE decodes from them averaged over each latent
pixel's 8x8 block; one least-squares map (C x 3 and a bias) over every latent pixel, saved as
`preview_rgb.json` with its fit error. `python -m neuron_app.training.preview_fit FOLDER` refits a
saved model; train-tiny writes it after training.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from neuron_app.engine.model import shapes_world as world
from neuron_app.engine.modes.previews import PREVIEW_FILE, latent_pixels
from neuron_app.training.data import encode, normalise, render_batch

SIZES = ((128, 128), (256, 128), (128, 256), (64, 64))


def fit(pipe: Any, rng: random.Random, per_size: int = 12) -> dict[str, Any]:
    """The least-squares map from normalised latent pixels to decoded RGB in [-1, 1], and how well it fits."""
    import numpy as np
    import torch

    inputs, targets = [], []
    with torch.no_grad():
        for width, height in SIZES:
            images = render_batch([world.random_scene(rng) for _ in range(per_size)], width, height, rng)
            patchified = encode(pipe, images)
            decoded = pipe.vae.decode(pipe._unpatchify_latents(patchified)).sample.clamp(-1, 1)
            pooled = torch.nn.functional.avg_pool2d(decoded, 8).permute(0, 2, 3, 1).numpy()  # (B, H/8, W/8, 3)
            packed = pipe._pack_latents(normalise(pipe, patchified))
            for i in range(per_size):
                x = latent_pixels(packed[i : i + 1], width, height)
                inputs.append(x.reshape(-1, x.shape[-1]))
                targets.append(pooled[i].reshape(-1, 3))
    x, y = np.concatenate(inputs), np.concatenate(targets)
    design = np.concatenate([x, np.ones((len(x), 1), np.float32)], axis=1)
    solution, *_ = np.linalg.lstsq(design.astype(np.float64), y.astype(np.float64), rcond=None)
    error = np.clip(design @ solution, -1, 1) - y
    return {
        "factors": [[round(float(v), 6) for v in row] for row in solution[:-1]],
        "bias": [round(float(v), 6) for v in solution[-1]],
        "fitted_on": f"{len(inputs)} rendered scenes at {', '.join(f'{w}x{h}' for w, h in SIZES)}",
        "rms_error_0_255": round(float(np.sqrt((error**2).mean()) * 127.5), 2),
    }


def write(pipe: Any, folder: Path, seed: int = 0) -> dict[str, Any]:
    fitted = fit(pipe, random.Random(seed))
    (folder / PREVIEW_FILE).write_text(json.dumps(fitted, indent=1) + "\n")
    return fitted


def main(argv: list[str] | None = None) -> int:
    from diffusers import Flux2KleinPipeline

    folder = Path((argv if argv is not None else sys.argv[1:])[0])
    fitted = write(Flux2KleinPipeline.from_pretrained(folder), folder)
    print(f"{folder / PREVIEW_FILE}: {fitted['fitted_on']}, RMS error {fitted['rms_error_0_255']} of 255")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
