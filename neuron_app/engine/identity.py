"""What identifies a manager's compiled graphs: the fields of the manifest's fingerprint.

Everything that changes a graph (the model's identity, dtype, device, compile mode and backend, sequence length,
batch, TP, the VAE's tiling, LoRA slots, the device's SDK and flags) and nothing that does not.
"""

from __future__ import annotations

from typing import Any

from neuron_app.environment import dist_version

BATCH_SIZE = 1


def fingerprint_fields(manager: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model": manager.source.identity,
        "dtype": manager.dtype_name,
        "device": manager.backend.name,
        "compile_mode": manager.settings.compile_mode,
        "compile_backend": manager.compile_backend,
        "max_sequence_length": manager.settings.max_sequence_length,
        "batch_size": BATCH_SIZE,
        "tp_degree": manager.settings.tp_degree,
        "torch": dist_version("torch") or "absent",
        "diffusers": dist_version("diffusers") or "absent",
    }
    if manager.vae_compiled:
        fields["vae_tile"] = f"{manager.settings.vae_tile}/{manager.settings.vae_tile_overlap}"
    if manager.vae_on_host:
        fields["vae_device"] = "cpu"
    if lora := manager.adapters.fingerprint():
        fields["lora"] = lora
    fields.update(manager.backend.fingerprint_fields())  # neuron: SDK versions, NEURON_CC_FLAGS, logical cores
    return fields
