"""How a tensor crosses between NeuronCores: through the host, as TorchNeuron requires (a direct copy between two
cores is refused). Base level: the model's placement and the modes both cross, and neither imports the other."""

from __future__ import annotations

from typing import Any


def to_core(value: Any, device: Any, dtype: Any = None) -> Any:
    """`value.to(device, dtype)`, and from another NeuronCore through the host: a read and a write (7.5 MiB for
    klein-4B's prompt embedding, once per prompt) instead of the direct copy TorchNeuron refuses. The one way a
    tensor crosses between cores here."""
    import torch

    target, here = torch.device(device), value.device
    if here.type == target.type == "neuron" and here.index != target.index:
        value = value.to("cpu")
    return value.to(device=target, dtype=dtype) if dtype is not None else value.to(target)
