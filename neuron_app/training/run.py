"""python -m neuron_app train-tiny: train `tiny-shapes` on the shapes world, on the CPU, within a time (or step) budget.

Stages, each a share of the budget: the VAE (reconstruction, then the latent batch-norm statistics the pipeline
de-normalises with); the transformer and the text encoder together with the flow-matching objective, at the
pipeline's own sampling sigmas for 1, 2, 4 and 8 steps (the world is deterministic given its prompt, so the
velocity a few-step sampler needs is learnable directly: no teacher), and for a share of the batches the 4-step
sampler itself, unrolled (losses.py); then the `outline` LoRA
on the frozen model; last, the live previews' latent-to-RGB map for this VAE (preview_fit.py). Everything goes
through the pipeline's own helpers (prompt encoding, patchify, pack, ids), so what is trained is what
`Flux2KleinPipeline.__call__` runs. Seeded; the log is JSON lines of loss by step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from neuron_app.engine.model import shapes_world as world
from neuron_app.engine.model.tiny import RECIPE_VERSION, SHAPES_RECIPE, build_pipeline
from neuron_app.training import preview_fit
from neuron_app.training.data import (
    SHAPE_EMPHASIS,
    SIZES,
    Bucket,
    build_buckets,
    render_batch,
    set_latent_statistics,
)
from neuron_app.training.losses import MISMATCH_SHARE, flow_loss, sampler_loss

log = logging.getLogger(__name__)

#: The attention projections the outline LoRA adapts (the usual FLUX LoRA targets; engine/modes/lora.py).
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_v_proj")
LORA_RANK = 8
EDIT_WEIGHT = 0.04  # how often each edit bucket is drawn, against data.SIZES' weights (4 buckets: ~15% of batches)
EMA_DECAY = 0.999  # the saved weights are an exponential moving average of the trained ones


@dataclass
class Plan:
    minutes: float = 20.0
    steps: int = 0  # > 0: each stage runs this many steps whatever the clock (the same run on a busy machine)
    seed: int = 0
    out: Path = Path("neuron_app/models/tiny-shapes")
    shares: dict[str, float] = field(default_factory=lambda: {"vae": 0.08, "transformer": 0.74, "lora": 0.18})
    scenes_per_size: int = 0  # 0: scaled with the budget (16 for a 2-minute smoke run, 160 from 27 minutes on)
    batch_tokens: int = 3072  # image tokens per transformer batch (48 images at 128x128)
    init: Path | None = None  # continue from a saved tiny-shapes (its VAE kept), instead of starting afresh
    sampler_share: float = 0.0  # the share of batches (both flow stages) through the unrolled sampler (sampler_loss)
    ema: bool = True  # save the moving average of each stage's weights (less residual noise in 4-step images)
    lr: float = 0.0  # the flow stage's peak learning rate (0: 1e-3 from scratch, 8e-4 continuing with --init)
    edit_weight: float = EDIT_WEIGHT  # each edit bucket's draw weight, against data.SIZES' (which sum to 0.94)
    mismatch_share: float = MISMATCH_SHARE  # low-sigma examples given another scene's prompt (losses.py says why)
    bf16_share: float = 0.0  # batches run under bfloat16 autocast: Neuron serves bfloat16 (train_flow says why)


class Log:
    """Loss against step, as JSON lines (and one log line every few seconds)."""

    def __init__(self, path: Path, earlier: str = "") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.start, self.shown = path, time.monotonic(), 0.0
        self.fh = path.open("w")
        self.fh.write(earlier)  # a continued run's log follows the one it continues

    def write(self, **row: Any) -> None:
        row = {"elapsed_s": round(time.monotonic() - self.start, 2), **row}
        self.fh.write(json.dumps(row) + "\n")
        self.fh.flush()
        if row["elapsed_s"] - self.shown > 10 or "loss" not in row:
            self.shown = row["elapsed_s"]
            log.info("train-tiny %s", " ".join(f"{k}={v}" for k, v in row.items()))


def _timed(seconds: float, steps: int = 0) -> Iterator[tuple[int, float]]:
    """(step, share of the stage gone) until its time runs out (at least 10 steps), or for exactly `steps` steps:
    a budget in steps makes a run that does not depend on how busy the machine is (the test's)."""
    if steps:
        yield from ((step, step / steps) for step in range(steps))
        return
    start, step = time.monotonic(), 0
    while step < 10 or time.monotonic() - start < seconds:
        yield step, min(1.0, (time.monotonic() - start) / seconds)
        step += 1


def _lr(step: int, done: float, base: float, warmup: int = 40, floor: float = 0.05) -> float:
    """Linear warm-up, then a cosine over the stage's time (the step rate is not known in advance)."""
    if step < warmup:
        return base * (step + 1) / warmup
    return base * max(floor, 0.5 * (1 + math.cos(math.pi * done)))


# --- stage 1: the VAE ---------------------------------------------------------------------------------------------
def train_vae(vae: Any, seconds: float, rng: random.Random, out: Log, steps: int = 0) -> None:
    """From 8x8 average pooling and back (vae_init.py), refined towards sharp edges on rendered scenes."""
    import torch

    from neuron_app.training.vae_init import average_pool_vae

    average_pool_vae(vae)
    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    for step, done in _timed(seconds, steps):
        size = rng.choice([(64, 64), (64, 64), (128, 64), (64, 128)])
        scenes = [world.random_scene(rng) for _ in range(12)]
        for i in range(len(scenes)):
            if rng.random() < 0.25:
                scenes[i] = replace(scenes[i], outline=True)
        x = render_batch(scenes, *size, rng)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, done, 1e-4)
        posterior = vae.encode(x).latent_dist
        # Decoded from the mean, as the pipeline encodes (argmax): an autoencoder, with a light KL keeping the
        # latents bounded (the pipeline's batch-norm statistics rescale them anyway).
        recon = vae.decode(posterior.mode()).sample
        mse = torch.nn.functional.mse_loss(recon, x)
        loss = mse + 0.5 * (recon - x).abs().mean() + 1e-7 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        out.write(stage="vae", step=step, loss=round(float(mse.detach()), 5))
    vae.eval()


# --- stage 2: the transformer and the text encoder ----------------------------------------------------------------
def _batch(plan: Plan, bucket: Bucket) -> int:
    tokens = bucket.latents.shape[1] * (2 if bucket.references is not None else 1)
    return max(6, min(64, plan.batch_tokens // tokens))


def train_flow(
    pipe: Any,
    params: list[Any],
    buckets: list[Bucket],
    plan: Plan,
    seconds: float,
    rng: random.Random,
    out: Log,
    stage: str,
    lr: float,
) -> None:
    import torch

    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    weights = [SIZES.get((b.width, b.height), 0.0) if b.references is None else plan.edit_weight for b in buckets]
    table: dict[int, list[list[float]]] = {}
    checks = [0.25, 0.5, 0.75]
    average = [p.detach().clone() for p in params] if plan.ema else []
    for step, done in _timed(seconds, plan.steps):
        if checks and done >= checks[0] and stage == "transformer":
            checks.pop(0)
            _eval_now(pipe, out, stage, step)
        bucket = rng.choices(buckets, weights)[0]
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, done, lr)
        # A share of batches under bfloat16 autocast: served in bfloat16 (Neuron), a model trained only in float32
        # leaves speckles of rounding noise in flat backgrounds and outline interiors.
        bf16 = plan.bf16_share > 0 and rng.random() < plan.bf16_share  # no draw at 0: seeded runs replay as before
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if rng.random() < plan.sampler_share:
                loss, split = sampler_loss(pipe, bucket, max(4, _batch(plan, bucket) // 2), rng, table)
            else:
                loss, split = flow_loss(pipe, bucket, _batch(plan, bucket), rng, table, plan.mismatch_share)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if average:
            decay = min(EMA_DECAY, (1 + step) / (10 + step))
            with torch.no_grad():
                for param, mean in zip(params, average, strict=True):
                    mean.lerp_(param, 1 - decay)
        out.write(
            stage=stage,
            step=step,
            loss=round(float(loss), 5),
            size=f"{bucket.width}x{bucket.height}",
            edit=bucket.references is not None,
            **split,
        )
    with torch.no_grad():
        for param, mean in zip(params, average, strict=True):
            param.copy_(mean)


def _eval_now(pipe: Any, out: Log, stage: str, step: int) -> None:
    import torch

    pipe.transformer.eval()
    pipe.text_encoder.eval()
    with torch.no_grad():
        out.write(stage="eval", during=stage, at_step=step, steps=4, size="128x128", **evaluate(pipe))
    pipe.transformer.train()
    pipe.text_encoder.train()


# --- stage 3: the outline LoRA ------------------------------------------------------------------------------------
def add_lora(transformer: Any, rank: int, generator: Any) -> dict[str, tuple[Any, Any]]:
    """Low-rank adapters on the target projections, applied by forward hooks (B starts at zero)."""
    import torch

    adapters = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(LORA_TARGETS):
            down = torch.nn.Parameter(torch.randn(rank, module.in_features, generator=generator) / rank)
            up = torch.nn.Parameter(torch.zeros(module.out_features, rank))

            def hook(mod: Any, args: Any, output: Any, down: Any = down, up: Any = up) -> Any:
                return output + args[0] @ down.t() @ up.t()

            adapters[name] = (down, up, module.register_forward_hook(hook))
    return adapters


def lora_state(adapters: dict[str, tuple[Any, Any, Any]]) -> dict[str, Any]:
    """diffusers' LoRA names (`load_lora_weights` reads them; alpha = rank, so the scale is 1)."""
    state = {}
    for name, (down, up, _) in adapters.items():
        state[f"transformer.{name}.lora_A.weight"] = down.detach().contiguous()
        state[f"transformer.{name}.lora_B.weight"] = up.detach().contiguous()
    return state


# --- the judge's verdict at the end -------------------------------------------------------------------------------
def evaluate(pipe: Any, steps: int = 4, size: tuple[int, int] = (128, 128), seed: int = 0) -> dict[str, int]:
    """The fixed 12 prompts through `pipe(...)`, read back by the judge: how many of each field are right."""
    import torch

    counts = {"background": 0, "colour": 0, "shape": 0, "position": 0}
    for i, scene in enumerate(world.EVAL_SCENES):
        image = pipe(
            prompt=scene.prompt,
            width=size[0],
            height=size[1],
            num_inference_steps=steps,
            guidance_scale=1.0,
            max_sequence_length=32,
            generator=torch.Generator().manual_seed(seed + i),
        ).images[0]
        for key, ok in world.judge(image).matches(scene).items():
            counts[key] += ok
    return counts


def _runs(folder: Path) -> list[dict[str, Any]]:
    """The runs a saved model came from (its tiny_recipe.json)."""
    summary = json.loads((folder / "tiny_recipe.json").read_text())
    return summary.get("runs") or [{k: v for k, v in summary.items() if k != "recipe"}]


def train(plan: Plan, progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """Run every stage and save the pipeline (and lora/outline.safetensors) into `plan.out`."""
    import torch
    from safetensors.torch import save_file

    if not plan.scenes_per_size:  # by the budget: 6 a minute, or one per 2 steps of a budget in steps
        plan.scenes_per_size = max(16, min(160, plan.steps // 2 if plan.steps else int(plan.minutes * 6)))
    plan.lr = plan.lr or (8e-4 if plan.init else 1e-3)  # the recipe records the rate used
    rng = random.Random(plan.seed)
    torch.manual_seed(plan.seed)
    budget = plan.minutes * 60
    staging = plan.out.with_name(plan.out.name + ".training")
    shutil.rmtree(staging, ignore_errors=True)
    earlier = (plan.init / "train-log.jsonl").read_text() if plan.init else ""
    history = _runs(plan.init) if plan.init else []
    out = Log(staging / "train-log.jsonl", earlier)
    started = time.monotonic()
    if plan.init:
        from diffusers import Flux2KleinPipeline

        pipe = Flux2KleinPipeline.from_pretrained(plan.init)
        out.write(stage="init", source=plan.init.name, runs_before=len(history))
    else:
        pipe = build_pipeline(SHAPES_RECIPE)
    pipe.set_progress_bar_config(disable=True)

    if not plan.init:
        train_vae(pipe.vae, budget * plan.shares["vae"], rng, out, plan.steps)
    with torch.no_grad():
        if not plan.init:
            set_latent_statistics(pipe, rng)
        buckets = build_buckets(pipe, plan.scenes_per_size, rng)
    out.write(stage="data", buckets=len(buckets), examples=sum(len(b.prompts) for b in buckets))

    pipe.vae.requires_grad_(False)
    pipe.transformer.train()
    pipe.text_encoder.train()
    params = list(pipe.transformer.parameters()) + list(pipe.text_encoder.parameters())
    left = budget - (time.monotonic() - started) - budget * plan.shares["lora"]
    train_flow(pipe, params, buckets, plan, max(10.0, left), rng, out, "transformer", plan.lr)
    pipe.transformer.eval()
    pipe.text_encoder.eval()
    with torch.no_grad():
        base = evaluate(pipe)
    out.write(stage="eval", steps=4, size="128x128", **base)

    pipe.transformer.requires_grad_(False)
    pipe.text_encoder.requires_grad_(False)
    with torch.no_grad():
        outline_buckets = build_buckets(pipe, plan.scenes_per_size, rng, outline=True)
    adapters = add_lora(pipe.transformer, LORA_RANK, torch.Generator().manual_seed(plan.seed))
    lora_params = [p for down, up, _ in adapters.values() for p in (down, up)]
    left = budget - (time.monotonic() - started)
    train_flow(pipe, lora_params, outline_buckets, plan, max(10.0, left), rng, out, "lora", 2e-3)
    state = lora_state(adapters)
    for *_, handle in adapters.values():
        handle.remove()

    for component in (pipe.vae, pipe.transformer, pipe.text_encoder):
        component.requires_grad_(True)
    for component in (pipe, pipe.vae, pipe.transformer):  # not the --init folder's path on this machine
        component.register_to_config(_name_or_path=plan.out.name)
    pipe.save_pretrained(staging)
    preview_fit.write(pipe, staging, plan.seed)  # the live previews' latent-to-RGB map for this VAE
    (staging / "lora").mkdir()
    save_file(state, str(staging / "lora" / "outline.safetensors"))
    recipe = asdict(SHAPES_RECIPE) | {"version": RECIPE_VERSION}
    run = {
        "plan": {
            "minutes": plan.minutes,
            "steps": plan.steps,
            "seed": plan.seed,
            "shares": plan.shares,
            "init": bool(plan.init),
            "scenes_per_size": plan.scenes_per_size,
            "batch_tokens": plan.batch_tokens,
            "sampler_share": plan.sampler_share,
            "ema": plan.ema,
            "shape_emphasis": SHAPE_EMPHASIS,
            "edit_weight": plan.edit_weight,
            "lr": plan.lr,
            "mismatch_share": plan.mismatch_share,
            "bf16_share": plan.bf16_share,
        },
        "train_s": round(time.monotonic() - started, 1),
        "eval_128x128_4_steps": base,
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {os.cpu_count()} logical cores, load {os.getloadavg()[0]:.1f} at the end",
    }
    summary = {"recipe": recipe, **run, "runs": [*history, run]}
    (staging / "tiny_recipe.json").write_text(json.dumps(summary, indent=1) + "\n")
    out.fh.close()
    shutil.rmtree(plan.out, ignore_errors=True)
    staging.rename(plan.out)
    progress(f"train-tiny: saved {plan.out} in {summary['train_s']} s; 12 prompts at 128x128, 4 steps: {base}")
    return summary
