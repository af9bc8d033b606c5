"""`klein-4b-random` / `klein-9b-random`: the real architectures at their real size with random weights, written once
into the cache folder as a diffusers pipeline folder and loaded through the same `from_pretrained` as the real model.

No one here can download klein, and no process had held one at its real size: this is what lets the emulator's
memory rule, the loader, the cut text encoder and the compile path meet 7-17 GiB transformers on this machine.
Each component is built on the `meta` device from the shipped spec (specs/*.json) and its tensors are drawn and
written one safetensors shard at a time, so building needs memory for one shard (about 1 GiB), not the model.
The weights are bfloat16 (what Neuron serves), drawn small (std 0.02; norms 1, biases 0) so activations stay finite
through every block: the images are noise, the sizes, shapes and costs are real.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from typing import Any

from neuron_app.engine.model.real.catalog import component_config, load_spec

log = logging.getLogger(__name__)

#: Bump when what is written changes, so that older folders are rebuilt.
VERSION = 1
#: `NEURON_APP_MODEL` names -> the spec they build.
RANDOM_MODELS = {"klein-4b-random": "klein-4b", "klein-9b-random": "klein-9b"}
SHARD_BYTES = 1 << 30
STD = 0.02


def folder_name(model: str) -> str:
    return f"{model}-v{VERSION}"


def ensure_random(models_dir: Path, model: str) -> Path:
    """The folder of `model`, built on first use (staged, then renamed: a crash leaves no half folder). One process
    builds while the others wait on its lock file (N pods on one cache folder write one copy, not N), and the
    staging folders a killed build left (15 GiB for 4B, 32 GiB for 9B) are removed first (issue 52, row 36)."""
    from neuron_app.engine.model.tiny import write_staged

    folder = models_dir / folder_name(model)
    models_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(models_dir, model):
        _remove_staging(models_dir, model)
        if not (folder / "model_index.json").is_file():
            write_staged(folder, lambda staging: build(staging, RANDOM_MODELS[model]))
    return folder


def remove_stale_staging(models_dir: Path) -> list[str]:
    """Every random model's staging folders that no live build owns (a build holds its lock), removed: what a
    start does whatever model it serves. Returns their names."""
    from filelock import Timeout

    removed: list[str] = []
    for model in RANDOM_MODELS:
        if not any(_staging(models_dir, model)):
            continue
        try:
            with _build_lock(models_dir, model, timeout=0):
                removed += _remove_staging(models_dir, model)
        except Timeout:  # a build in progress: its folder is not stale
            continue
    return removed


def _build_lock(models_dir: Path, model: str, timeout: float = -1) -> Any:
    from filelock import FileLock

    return FileLock(str(models_dir / f".{folder_name(model)}.lock"), timeout=timeout)


def _staging(models_dir: Path, model: str) -> list[Path]:
    """`write_staged`'s folders for `model` (`.<folder>-<random>`), not its lock file."""
    return [p for p in models_dir.glob(f".{folder_name(model)}-*") if p.is_dir() and not p.is_symlink()]


def _remove_staging(models_dir: Path, model: str) -> list[str]:
    """With the model's build lock held, its staging folders are a dead build's: removed, one line each."""
    import shutil

    names = []
    for stale in _staging(models_dir, model):
        shutil.rmtree(stale, ignore_errors=True)
        log.warning("removed %s, left by a %s build that did not finish", stale.name, model)
        names.append(stale.name)
    return names


def _meta_components(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        return {
            "transformer": Flux2Transformer2DModel(**component_config(spec, "transformer")),
            "text_encoder": Qwen3ForCausalLM(Qwen3Config(**component_config(spec, "text_encoder"))),
            "vae": AutoencoderKLFlux2(**component_config(spec, "vae")),
        }


#: Random values drawn once and tiled: drawing 4-9 billion normals took minutes on 2 cores; slicing a 16M-value pool
#: at a per-tensor offset is a copy. Weights repeat with a period of 16M values, which no shape or cost depends on.
POOL_VALUES = 1 << 24
_pool: list[Any] = []


def _draw(name: str, shape: tuple[int, ...]) -> Any:
    import torch

    if name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if len(shape) == 1:  # norm scales (and the few 1-D parameters): 1 keeps activations where a trained model has them
        return torch.ones(shape, dtype=torch.bfloat16)
    if not _pool:
        generator = torch.Generator().manual_seed(0)
        _pool.append((torch.randn(POOL_VALUES, generator=generator) * STD).to(torch.bfloat16))
    pool, count = _pool[0], _numel(shape)
    if count > POOL_VALUES:  # the few tensors past the pool (embeddings, the widest projections): the pool repeated
        return pool.repeat(-(-count // POOL_VALUES))[:count].reshape(shape)
    start = zlib.crc32(name.encode()) % (POOL_VALUES - count + 1)  # each tensor its own window of the pool
    return pool[start : start + count].reshape(shape).clone()


def _write_weights(module: Any, folder: Path, stem: str, index_name: str) -> int:
    """Every tensor of `module` (tied ones once), drawn and written in shards of about SHARD_BYTES; the index as
    `save_pretrained` writes it. Returns the bytes written."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    entries: list[tuple[str, tuple[int, ...]]] = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:  # a tied weight (Qwen3's lm_head is its embeddings): stored once, as save_pretrained does
            continue
        seen.add(key)
        entries.append((name, tuple(tensor.shape)))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in entries:
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for number, shard in enumerate(shards, 1):
        file = f"{stem}-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _draw(name, shape) for name, shape in shard}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map |= dict.fromkeys(tensors, file)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / index_name).write_text(json.dumps(index, indent=2))
    return total


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for side in shape:
        count *= side
    return count


def build(folder: Path, spec_name: str) -> None:
    """Write the pipeline folder: model_index.json, each component's config and weights, the scheduler, and the
    tiny byte-level tokenizer (its ids fit the real 151,936-row embedding; klein's own tokenizer is not shipped)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    from neuron_app.engine.model.tiny import build_tokenizer

    spec = load_spec(spec_name)
    parts = _meta_components(spec)
    written = 0
    written += _write_weights(
        parts["transformer"],
        folder / "transformer",
        "diffusion_pytorch_model",
        "diffusion_pytorch_model.safetensors.index.json",
    )
    parts["transformer"].save_config(folder / "transformer")
    written += _write_weights(
        parts["vae"], folder / "vae", "diffusion_pytorch_model", "diffusion_pytorch_model.safetensors.index.json"
    )
    parts["vae"].save_config(folder / "vae")
    encoder = parts["text_encoder"]
    written += _write_weights(encoder, folder / "text_encoder", "model", "model.safetensors.index.json")
    encoder.config.save_pretrained(folder / "text_encoder")
    scheduler = FlowMatchEulerDiscreteScheduler(**component_config(spec, "scheduler"))
    scheduler.save_config(folder / "scheduler")
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder / "tokenizer")
    pipe = Flux2KleinPipeline(
        scheduler=scheduler,
        vae=parts["vae"],
        text_encoder=encoder,
        tokenizer=tokenizer,
        transformer=parts["transformer"],
        is_distilled=spec["pipeline"].get("is_distilled", True),
    )
    pipe.save_config(folder)  # model_index.json: the class of each component
    (folder / "random_weights.json").write_text(json.dumps({"spec": spec_name, "version": VERSION, "std": STD}))
    log.info("%s: %.1f GiB of random bfloat16 weights written", spec_name, written / 2**30)
