"""The training data of tiny-shapes: rendered scenes at every trained size, encoded once by the VAE into the
normalised, packed latents the transformer sees (and edit pairs), through the pipeline's own helpers."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from neuron_app.engine.model import shapes_world as world

#: Image sizes trained (width, height): every multiple of 64 from 64 to 256 px within aspect 1:2..2:1, with
#: weights that favour the shapes the app serves by default (128x128, and the quick start's 256 px family).
SIZES: dict[tuple[int, int], float] = {
    (128, 128): 0.26,
    (64, 64): 0.08,
    (128, 64): 0.05,
    (64, 128): 0.05,
    (192, 192): 0.04,
    (256, 256): 0.1,
    (256, 128): 0.1,
    (128, 256): 0.1,
    (192, 128): 0.04,
    (128, 192): 0.04,
    (256, 192): 0.02,
    (192, 256): 0.02,
}
EDIT_SIZES = ((128, 128), (64, 64), (128, 64), (64, 128))


def render_batch(scenes: list[world.Scene], width: int, height: int, rng: random.Random) -> Any:
    """Rendered scenes as a (B, 3, H, W) tensor in [-1, 1], with small jitter of place and size."""
    import numpy as np
    import torch

    arrays = []
    for scene in scenes:
        jitter = (rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03), rng.uniform(-0.06, 0.06))
        arrays.append(np.asarray(world.render(scene, width, height, jitter), dtype=np.float32))
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 127.5 - 1.0


def encode(pipe: Any, images: Any) -> Any:
    """Images -> patchified latents (the pipeline's `_encode_vae_image` before its normalisation)."""
    import torch

    with torch.no_grad():
        latents = pipe.vae.encode(images).latent_dist.mode()
    return pipe._patchify_latents(latents)


def set_latent_statistics(pipe: Any, rng: random.Random, count: int = 384) -> None:
    """The batch-norm statistics the pipeline normalises latents with: measured over rendered scenes."""
    import torch

    parts = []
    for _ in range(count // 32):
        size = rng.choice(list(SIZES))
        parts.append(encode(pipe, render_batch([world.random_scene(rng) for _ in range(32)], *size, rng)))
    flat = torch.cat([p.permute(0, 2, 3, 1).reshape(-1, p.shape[1]) for p in parts])
    bn = pipe.vae.bn
    bn.running_mean.copy_(flat.mean(0))
    bn.running_var.copy_(flat.var(0))
    bn.num_batches_tracked.fill_(1)


@dataclass
class Bucket:
    """Training examples at one size: normalised packed latents, their prompts, optional references."""

    width: int
    height: int
    latents: Any  # (N, tokens, channels)
    prompts: list[str]
    references: Any = None  # (N, tokens, channels) for edit pairs
    latent_ids: Any = None
    reference_ids: Any = None


def normalise(pipe: Any, patchified: Any) -> Any:
    bn = pipe.vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1)
    std = (bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps).sqrt()
    return (patchified - mean) / std


def build_buckets(pipe: Any, per_size: int, rng: random.Random, outline: bool = False) -> list[Bucket]:
    """Scenes rendered at every trained size, encoded once (and edit pairs at the edit sizes)."""
    buckets = []
    for width, height in SIZES:
        count = int(per_size * (2 if (width, height) == (128, 128) else 1))
        scenes = [world.random_scene(rng) for _ in range(count)]
        if outline:
            scenes = [replace(s, outline=True) for s in scenes]
        latents = normalise(pipe, encode(pipe, render_batch(scenes, width, height, rng)))
        ids = pipe._prepare_latent_ids(latents[:1])
        buckets.append(Bucket(width, height, pipe._pack_latents(latents), [s.prompt for s in scenes], None, ids))
    if outline:
        return buckets
    for width, height in EDIT_SIZES:
        sources = [world.random_scene(rng, positions=True) for _ in range(per_size)]
        targets, prompts = [], []
        for scene in sources:
            colour = rng.choice([c for c in world.COLOURS if c not in (scene.colour, scene.background)])
            targets.append(world.edited(scene, colour))
            prompts.append(f"make the {scene.shape} {colour}")
        seed = rng.random()
        # The same jitter for a source and its target: only the colour changes.
        source_images = render_batch(sources, width, height, random.Random(seed))
        target_images = render_batch(targets, width, height, random.Random(seed))
        refs = normalise(pipe, encode(pipe, source_images))
        target = normalise(pipe, encode(pipe, target_images))
        ids = pipe._prepare_latent_ids(target[:1])
        ref_ids = pipe._prepare_image_ids([refs[:1]])
        buckets.append(
            Bucket(width, height, pipe._pack_latents(target), prompts, pipe._pack_latents(refs), ids, ref_ids)
        )
    return buckets
