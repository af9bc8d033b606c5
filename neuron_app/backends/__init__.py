"""Device backends behind one interface; the neuron SDK is imported only when chosen."""

from __future__ import annotations

from pathlib import Path

from neuron_app.backends.base import DeviceBackend
from neuron_app.errors import DeviceUnavailable

__all__ = ["DeviceBackend", "get_backend", "resolve_backend"]


def get_backend(name: str) -> DeviceBackend:
    """The backend class for `name` (neuron, cuda, cpu); nothing is imported from its SDK yet."""
    if name == "neuron":
        from neuron_app.backends.neuron import NeuronBackend

        return NeuronBackend()
    if name == "neuron-emulated":
        from neuron_app.backends.neuron_emulated import NeuronEmulatedBackend

        return NeuronEmulatedBackend()
    if name == "cuda":
        from neuron_app.backends.cuda import CudaBackend

        return CudaBackend()
    if name == "cpu":
        from neuron_app.backends.cpu import CpuBackend

        return CpuBackend()
    raise DeviceUnavailable(f"unknown device {name!r}: choose auto, neuron, neuron-emulated, cuda or cpu")


def resolve_backend(name: str, cache_dir: Path, *, check_device: bool = True) -> DeviceBackend:
    """`auto` picks neuron, then cuda, then cpu; an explicit choice must be available.

    The cache folder is prepared before the backend's SDK is imported: Neuron reads its
    cache location once, when torch autoloads it. `check_device=False` leaves the device checks
    to the caller (torchrun ranks run them after init_process_group).
    """
    candidates = ("neuron", "cuda", "cpu") if name == "auto" else (name,)
    for candidate in candidates:
        backend = get_backend(candidate)
        if name == "auto" and not backend.is_available():
            continue
        backend.prepare_cache(cache_dir)
        if check_device:
            backend.require()
        else:
            backend.require_sdk()
        return backend
    raise DeviceUnavailable("no device available")  # unreachable: cpu is always available
