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
    (256, 128): 0.14,
    (128, 256): 0.1,
    (192, 128): 0.04,
    (128, 192): 0.04,
    (256, 192): 0.02,
    (192, 256): 0.02,
}
EDIT_SIZES = ((128, 128), (64, 64), (128, 64), (64, 128))
#: How much more the tokens the shape word decides weigh than those the position and size words do: a circle and a
#: square differ in a few corner tokens, and under less weight the model drew a blob that hedges between shapes.
SHAPE_EMPHASIS = 3.0


Jitter = tuple[float, float, float]


def jitters(count: int, rng: random.Random) -> list[Jitter]:
    """Small moves of place and size, one per scene."""
    return [(rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03), rng.uniform(-0.06, 0.06)) for _ in range(count)]


def render_batch(
    scenes: list[world.Scene], width: int, height: int, rng: random.Random, moved: list[Jitter] | None = None
) -> Any:
    """Rendered scenes as a (B, 3, H, W) tensor in [-1, 1], with small jitter of place and size."""
    import numpy as np
    import torch

    moved = moved or jitters(len(scenes), rng)
    arrays = [np.asarray(world.render(s, width, height, j), np.float32) for s, j in zip(scenes, moved, strict=True)]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 127.5 - 1.0


def _coverage(scene: world.Scene, width: int, height: int, jitter: Jitter) -> Any:
    """The share of each latent token (16x16 px) the scene's shape covers, (tokens,) in the packed order."""
    import numpy as np

    mask = world.Scene("white", scene.shape, "black", scene.position, scene.size, scene.outline)
    pixels = np.asarray(world.render(mask, width // 4, height // 4, jitter), dtype=np.float32)[..., 0]
    share = (pixels - world.COLOURS["black"][0]) / (world.COLOURS["white"][0] - world.COLOURS["black"][0])
    return share.reshape(height // 16, 4, width // 16, 4).mean(axis=(1, 3)).reshape(-1)


def _alternatives(scene: world.Scene) -> list[world.Scene]:
    """The scenes a model that missed one word of the prompt would draw instead: another shape, the centre, the
    medium size, the filled shape for an outline."""
    others = [replace(scene, shape=shape) for shape in world.SHAPES if shape != scene.shape]
    if scene.position != "centre":
        others.append(replace(scene, position="centre"))
    if scene.size != "medium":
        others.append(replace(scene, size="medium"))
    if scene.outline:
        others.append(replace(scene, outline=False))
    return others


def decisive_tokens(scenes: list[world.Scene], width: int, height: int, moved: list[Jitter]) -> Any:
    """(N, tokens, 1) in [0, SHAPE_EMPHASIS]: how much each token's content depends on the shape, position, size and
    style words (the largest change of its coverage over `_alternatives`, a change of shape counted SHAPE_EMPHASIS
    times). The loss weighs these tokens up: they are few, and where an alternative would draw but the scene does
    not (a shape drawn at the centre instead of on the left) is background, which a weight on the shape's own tokens
    alone leaves cheap to get wrong."""
    import numpy as np
    import torch

    rows = []
    for scene, jitter in zip(scenes, moved, strict=True):
        own = _coverage(scene, width, height, jitter)
        changes = [
            np.abs(own - _coverage(alt, width, height, jitter)) * (1 if alt.shape == scene.shape else SHAPE_EMPHASIS)
            for alt in _alternatives(scene)
        ]
        rows.append(np.max(changes, axis=0))
    return torch.from_numpy(np.stack(rows)).unsqueeze(-1)


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
    decisive: Any = None  # (N, tokens, 1): decisive_tokens
    positioned: Any = None  # (N,) bool: the prompt names a position (the log splits the loss by it)


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
        moved = jitters(len(scenes), rng)
        latents = normalise(pipe, encode(pipe, render_batch(scenes, width, height, rng, moved)))
        ids = pipe._prepare_latent_ids(latents[:1])
        prompts = [s.prompt for s in scenes]
        decisive = decisive_tokens(scenes, width, height, moved)
        buckets.append(
            Bucket(width, height, pipe._pack_latents(latents), prompts, None, ids, None, decisive, _positioned(scenes))
        )
    if outline:
        return buckets
    for width, height in EDIT_SIZES:
        sources = [world.random_scene(rng, positions=True) for _ in range(per_size)]
        targets, prompts = [], []
        for scene in sources:
            colour = rng.choice([c for c in world.COLOURS if c not in (scene.colour, scene.background)])
            targets.append(world.edited(scene, colour))
            prompts.append(f"make the {scene.shape} {colour}")
        # The same jitter for a source and its target: only the colour changes.
        moved = jitters(len(sources), rng)
        refs = normalise(pipe, encode(pipe, render_batch(sources, width, height, rng, moved)))
        target = normalise(pipe, encode(pipe, render_batch(targets, width, height, rng, moved)))
        ids = pipe._prepare_latent_ids(target[:1])
        ref_ids = pipe._prepare_image_ids([refs[:1]])
        decisive = decisive_tokens(targets, width, height, moved)
        refs, target = pipe._pack_latents(refs), pipe._pack_latents(target)
        buckets.append(Bucket(width, height, target, prompts, refs, ids, ref_ids, decisive, _positioned(targets)))
    return buckets


def _positioned(scenes: list[world.Scene]) -> Any:
    import torch

    return torch.tensor([s.position != "centre" for s in scenes])
