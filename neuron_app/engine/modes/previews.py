"""Live previews: a small picture of the latents after each denoising step, made on the host.

No VAE call, no device graph, no compile: the packed latents (B, tokens, 128) are copied to the host, unpacked
to the VAE's 32 channels at 1/8 of the image's size (FLUX.2 packs 2x2 patches of 32 channels into 128) and
projected to RGB by a fixed linear map. A model trained here ships its own map beside its weights
(`preview_rgb.json`, fitted by least squares from its latents to what its VAE decodes:
training/preview_fit.py), read once at load (engine/model/loader.py). Otherwise, for FLUX.2's VAE,
the map is the published 32x3 latent-to-RGB factors (ComfyUI's `comfy/latent_formats.py`, class Flux2, which
acts on the same batch-normalized latents the transformer denoises); any other channel count (the tiny model
has 1) gets a generic map: the channels' mean as gray, stretched to the preview's range. The preview is a
quarter of the image's size a side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_app.engine.records import ProgressEvent

#: Preview side = image side / PREVIEW_DIVISOR (the latents are 1/8; the browser scales the rest).
PREVIEW_DIVISOR = 4

#: FLUX.2 VAE (32 channels) -> RGB, from ComfyUI's latent_formats.Flux2 (factors per channel, then bias).
FLUX2_RGB = (
    (0.0058, 0.0113, 0.0073),
    (0.0495, 0.0443, 0.0836),
    (-0.0099, 0.0096, 0.0644),
    (0.2144, 0.3009, 0.3652),
    (0.0166, -0.0039, -0.0054),
    (0.0157, 0.0103, -0.0160),
    (-0.0398, 0.0902, -0.0235),
    (-0.0052, 0.0095, 0.0109),
    (-0.3527, -0.2712, -0.1666),
    (-0.0301, -0.0356, -0.0180),
    (-0.0107, 0.0078, 0.0013),
    (0.0746, 0.0090, -0.0941),
    (0.0156, 0.0169, 0.0070),
    (-0.0034, -0.0040, -0.0114),
    (0.0032, 0.0181, 0.0080),
    (-0.0939, -0.0008, 0.0186),
    (0.0018, 0.0043, 0.0104),
    (0.0284, 0.0056, -0.0127),
    (-0.0024, -0.0022, -0.0030),
    (0.1207, -0.0026, 0.0065),
    (0.0128, 0.0101, 0.0142),
    (0.0137, -0.0072, -0.0007),
    (0.0095, 0.0092, -0.0059),
    (0.0000, -0.0077, -0.0049),
    (-0.0465, -0.0204, -0.0312),
    (0.0095, 0.0012, -0.0066),
    (0.0290, -0.0034, 0.0025),
    (0.0220, 0.0169, -0.0048),
    (-0.0332, -0.0457, -0.0468),
    (-0.0085, 0.0389, 0.0609),
    (-0.0076, 0.0003, -0.0043),
    (-0.0111, -0.0460, -0.0614),
)
FLUX2_RGB_BIAS = (-0.0329, -0.0718, -0.0851)
#: A model folder's own latent-to-RGB map: {"factors": C rows of 3, "bias": 3, ...how it was fitted}.
PREVIEW_FILE = "preview_rgb.json"

Factors = tuple[tuple[tuple[float, ...], ...], tuple[float, ...]]


def read_factors(folder: Path) -> Factors | None:
    """A model folder's fitted map (PREVIEW_FILE), or None when it has none."""
    path = folder / PREVIEW_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return tuple(tuple(float(v) for v in row) for row in data["factors"]), tuple(float(v) for v in data["bias"])


def preview_size(width: int, height: int) -> tuple[int, int]:
    return max(1, width // PREVIEW_DIVISOR), max(1, height // PREVIEW_DIVISOR)


def _subpixels(packed: Any, width: int, height: int) -> Any:
    """The first image's packed latents as (tokens, 2x2 sub-pixels, C) float32 numpy, a view."""
    import torch

    x = packed.detach().to("cpu")[0].to(torch.float32).numpy()  # the one device-to-host copy; the rest on the host
    channels = x.shape[-1] // 4
    return x.reshape((height // 16) * (width // 16), channels, 4).transpose(0, 2, 1)


def _grid(values: Any, width: int, height: int) -> Any:
    """(tokens, 4, K) -> (H/8, W/8, K): the inverse of the pipeline's patchify-and-pack."""
    rows, cols = height // 16, width // 16
    k = values.shape[-1]
    return values.reshape(rows, cols, 2, 2, k).transpose(0, 2, 1, 3, 4).reshape(rows * 2, cols * 2, k)


def latent_pixels(packed: Any, width: int, height: int) -> Any:
    """Packed latents (B, (H/16)*(W/16), 4*C) as the first image's latent pixels, (H/8, W/8, C)."""
    return _grid(_subpixels(packed, width, height), width, height)


def latent_preview(packed: Any, width: int, height: int, factors: Factors | None = None) -> Any:
    """An RGB PIL preview of packed latents (B, (H/16)*(W/16), 4*C) for a `width` x `height` image, through the
    model's own `factors` (read_factors) when it has them.

    numpy on one thread: torch's intra-op threads cost more than the work on a busy host (60 vs 5 ms at
    1024x1024 on the 2-core CI machine); the map runs on the packed view, before the pixels are rearranged."""
    import numpy as np
    from PIL import Image

    x = _subpixels(packed, width, height)
    channels = x.shape[-1]
    if factors is None and channels == len(FLUX2_RGB):
        factors = FLUX2_RGB, FLUX2_RGB_BIAS
    if factors is not None and len(factors[0]) == channels:
        rgb = np.matmul(x, np.asarray(factors[0], np.float32)) + np.asarray(factors[1], np.float32)
        rgb = (np.clip(rgb, -1.0, 1.0) + 1.0) * 127.5  # (tokens, 4, 3)
    else:  # no factors for these channels: gray from the channels' mean, stretched
        gray = x.mean(-1)
        low, high = float(gray.min()), float(gray.max())
        gray = (gray - low) * (255.0 / (high - low)) if high > low else np.full_like(gray, 127.5)
        rgb = np.repeat(gray[..., None], 3, axis=-1)
    image = Image.fromarray((_grid(rgb, width, height) + 0.5).astype(np.uint8), "RGB")
    return image.resize(preview_size(width, height), Image.Resampling.BILINEAR)


@dataclass(frozen=True)
class PreviewEvent(ProgressEvent):
    """A denoising step's progress event with its preview (an RGB PIL image)."""

    preview: Any = field(default=None, compare=False, repr=False)
