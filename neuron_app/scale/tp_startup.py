"""Tensor parallelism's start-up checks, before anything loads: one process per rank, the degree against torchrun's
WORLD_SIZE and the transformer's head count, no LoRA on a sharded transformer (scale/distributed.py runs them)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from neuron_app.environment import launched_by_torchrun
from neuron_app.errors import SettingsError, one_line
from neuron_app.settings import Settings

log = logging.getLogger(__name__)

#: Head counts of known models, for the start-up check when the model's config cannot be read yet.
KNOWN_HEADS = {"black-forest-labs/FLUX.2-klein-4B": 24}


def check_single_process(settings: Settings) -> None:
    """`tp_degree > 1` needs one process per NeuronCore: refuse to start as one process (replicas start their
    groups themselves, `start_group`)."""
    if settings.tp_degree > 1 and not launched_by_torchrun() and not settings.uses_replicas:
        n = settings.tp_degree
        raise SettingsError(
            f"tp_degree={n} needs {n} processes, one per NeuronCore: start `torchrun --nproc_per_node={n} app.py` "
            "(scripts/launch-trn.sh does it when TP > 1), or set NEURON_APP_TP_DEGREE=1"
        )


def settings_for_world(world_size: int) -> Settings:
    """The process settings with `tp_degree` = torchrun's WORLD_SIZE (it is part of the compile fingerprint),
    passed as an argument: the environment is left as torchrun set it."""
    from neuron_app.settings import load_settings

    settings = load_settings()
    if settings.tp_degree == world_size:
        return settings
    if settings.tp_degree != 1:
        raise SettingsError(
            f"tp_degree={settings.tp_degree} is configured but torchrun started {world_size} processes (WORLD_SIZE): "
            f"use `torchrun --nproc_per_node={settings.tp_degree}` or change tp_degree"
        )
    return load_settings(tp_degree=world_size)


def transformer_heads(settings: Settings) -> int | None:
    """The transformer's attention head count from its config (None when it cannot be read here)."""
    from neuron_app.engine.model.loader import resolve_source
    from neuron_app.engine.model.tiny import ensure_tiny

    source = resolve_source(settings)
    try:
        if source.tiny:
            folder = ensure_tiny(settings.cache_dir / "models", source.tiny)
            config_path = folder / "transformer" / "config.json"
        elif source.is_local:
            config_path = Path(source.location) / "transformer" / "config.json"
        else:
            from huggingface_hub import hf_hub_download

            token = settings.hf_token.get_secret_value() if settings.hf_token else None
            config_path = Path(
                hf_hub_download(source.location, "transformer/config.json", revision=source.revision, token=token)
            )
        return int(json.loads(config_path.read_text())["num_attention_heads"])
    except Exception as exc:
        known = KNOWN_HEADS.get(source.location)
        log.warning("could not read the transformer config (%s); assuming %s heads", one_line(exc), known)
        return known


def check_tp_degree(degree: int, heads: int | None) -> None:
    """Each rank gets heads/degree attention heads: the degree must divide the head count."""
    if heads is None or degree <= 1:
        return
    if heads % degree:
        fits = [d for d in range(2, heads + 1) if heads % d == 0]
        raise SettingsError(
            f"tensor-parallel degree {degree} does not divide the transformer's {heads} attention heads: "
            f"use one of {', '.join(map(str, fits))} (torchrun --nproc_per_node=N)"
        )


def check_loras_unsharded(settings: Settings, mesh: Any) -> None:
    """diffusers adds no LoRA adapter to a sharded transformer (its layers are outside the `_tp_plan`): refuse the
    combination before the model loads, not after."""
    if mesh is not None and settings.loras:
        raise SettingsError(
            f"LoRA styles ({', '.join(sorted(settings.loras))}) cannot be served with tensor parallelism: diffusers "
            "cannot add adapters to a sharded transformer. Unset NEURON_APP_LORAS, or serve with tp_degree=1"
        )
