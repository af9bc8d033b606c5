"""The training objectives of tiny-shapes, through the pipeline's own prompt encoding, ids and sigmas: the
flow-matching loss at the sigmas `Flux2KleinPipeline.__call__` visits, and the same 4-step sampler unrolled."""

from __future__ import annotations

import itertools
import random
from typing import Any

from neuron_app.training.data import Bucket

SEQUENCE_LENGTHS = (32, 32, 32, 32, 32, 64)  # prompts padded as the app pads them (max_sequence_length)
DECISIVE_WEIGHT = 5.0  # flow_loss: the extra weight of the tokens the shape, position, size and style words decide
#: Image-to-image starts from the source noised to a low sigma. In this world a prompt has one image, so a model
#: trained only on matching pairs has no reason to read the noisy image over the prompt there; a share of the
#: examples below this sigma carry another scene's prompt with their own target, which teaches it to.
MISMATCH_SIGMA, MISMATCH_SHARE = 0.6, 0.15


def _velocity(pipe: Any, bucket: Bucket, index: Any, x: Any, sigma: Any, embeds: Any) -> Any:
    """The transformer's velocity for the image tokens `x` at `sigma` (an edit's reference tokens appended, as the
    pipeline appends them)."""
    import torch

    batch = x.shape[0]
    hidden, ids = x, bucket.latent_ids.expand(batch, -1, -1)
    if bucket.references is not None:
        hidden = torch.cat([x, bucket.references[index]], dim=1)
        ids = torch.cat([ids, bucket.reference_ids.expand(batch, -1, -1)], dim=1)
    return pipe.transformer(
        hidden_states=hidden,
        timestep=sigma,
        guidance=None,
        encoder_hidden_states=embeds,
        txt_ids=pipe._prepare_text_ids(embeds),
        img_ids=ids,
        return_dict=False,
    )[0][:, : x.shape[1]]


def _weighted_error(prediction: Any, target: Any, weight: Any) -> Any:
    """Per example: the squared error, each token weighted, as a weighted mean over tokens and channels."""
    return (weight * (prediction - target) ** 2).sum(dim=(1, 2)) / (weight.sum(dim=(1, 2)) * target.shape[-1])


def sampling_sigmas(pipe: Any, tokens: int, steps: int) -> list[float]:
    """The sigmas `Flux2KleinPipeline.__call__` visits at this image size and step count (before the last 0)."""
    import numpy as np
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    scheduler = pipe.scheduler
    mu = compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
    sigmas = np.linspace(1.0, 1 / steps, steps)
    return [float(scheduler.time_shift(mu, 1.0, s)) for s in sigmas]


def _schedules(pipe: Any, tokens: int, table: dict[int, list[list[float]]]) -> list[list[float]]:
    """The sigmas of the 1-, 2-, 4- and 8-step samplers at this token count (kept in `table`)."""
    if tokens not in table:
        table[tokens] = [sampling_sigmas(pipe, tokens, n) for n in (1, 2, 4, 8)]
    return table[tokens]


def _sigma(pipe: Any, tokens: int, rng: random.Random, table: dict[int, list[list[float]]]) -> float:
    if rng.random() < 0.6:
        schedules = _schedules(pipe, tokens, table)
        return rng.choice(rng.choice([*schedules, schedules[2]]))  # the 4-step sigmas twice as often
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    mu = compute_empirical_mu(image_seq_len=tokens, num_steps=4)
    return float(pipe.scheduler.time_shift(mu, 1.0, rng.uniform(0.02, 1.0)))


def flow_loss(
    pipe: Any, bucket: Bucket, batch: int, rng: random.Random, table: dict, mismatch: float = MISMATCH_SHARE
) -> Any:
    """One flow-matching loss on `batch` examples of a bucket, through the pipeline's own prompt encoding
    (`mismatch`: the share of low-sigma examples given another scene's prompt, MISMATCH_SHARE says why)."""
    import torch

    index = torch.tensor([rng.randrange(len(bucket.prompts)) for _ in range(batch)])
    x0 = bucket.latents[index]
    prompts = [bucket.prompts[i] for i in index.tolist()]
    sigma = torch.tensor([_sigma(pipe, x0.shape[1], rng, table) for _ in range(batch)])
    if bucket.references is None:
        for i, s in enumerate(sigma.tolist()):
            if s < MISMATCH_SIGMA and rng.random() < mismatch:
                prompts[i] = rng.choice(bucket.prompts)
    embeds = pipe._get_qwen3_prompt_embeds(
        pipe.text_encoder, pipe.tokenizer, prompts, max_sequence_length=rng.choice(SEQUENCE_LENGTHS)
    )
    noise = torch.randn_like(x0)
    x_t = (1 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * noise
    prediction = _velocity(pipe, bucket, index, x_t, sigma, embeds)
    # The shape is a few tokens among many of background: weigh the tokens away from the image's median token
    # (the background) four times, or the background is learnt long before the shape's colour; and the tokens
    # the shape, position, size and style words decide (data.decisive_tokens) five times more, or the model
    # draws a centred blob of the right colours whatever those words say.
    per_example = _weighted_error(prediction, noise - x0, token_weights(bucket, index, x0))
    split = {}
    if bucket.positioned is not None:
        positioned = bucket.positioned[index]
        for name, rows in (("loss_positioned", positioned), ("loss_centred", ~positioned)):
            if rows.any():
                split[name] = round(float(per_example[rows].detach().mean()), 5)
    return per_example.mean(), split


def token_weights(bucket: Bucket, index: Any, x0: Any) -> Any:
    """The loss's weight of each token (flow_loss says why)."""
    away = (x0 - x0.median(dim=1, keepdim=True).values).norm(dim=-1, keepdim=True) > 0.5
    weight = 1.0 + 3.0 * away.float()
    if bucket.decisive is not None:
        weight = weight + DECISIVE_WEIGHT * bucket.decisive[index]
    return weight


def sampler_loss(pipe: Any, bucket: Bucket, batch: int, rng: random.Random, table: dict) -> Any:
    """The 4-step Euler sampler the pipeline runs, unrolled from pure noise and back-propagated: its output
    against the scene. The flow loss alone learns each step's average velocity, and a few steps of averages give a
    soft, grainy drawing (klein's own few-step sampling comes from distillation); this trains the sampler's result
    itself, as the app runs it (the same sigmas, prompt encoding and ids)."""
    import torch

    index = torch.tensor([rng.randrange(len(bucket.prompts)) for _ in range(batch)])
    x0 = bucket.latents[index]
    prompts = [bucket.prompts[i] for i in index.tolist()]
    embeds = pipe._get_qwen3_prompt_embeds(pipe.text_encoder, pipe.tokenizer, prompts, max_sequence_length=32)
    sigmas = [*_schedules(pipe, x0.shape[1], table)[2], 0.0]
    x = torch.randn_like(x0)
    for now, after in itertools.pairwise(sigmas):
        x = x + (after - now) * _velocity(pipe, bucket, index, x, torch.full((batch,), now), embeds)
    per_example = _weighted_error(x, x0, token_weights(bucket, index, x0))
    return per_example.mean(), {"sampler": True}
