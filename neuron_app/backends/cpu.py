"""CPU: always there; used by the tests and the no-hardware demo with the tiny model."""

from __future__ import annotations

from neuron_app.backends.base import DeviceBackend


class CpuBackend(DeviceBackend):
    name = "cpu"
    default_dtype = "float32"
    dist_backend = "gloo"

    def is_available(self) -> bool:
        return True
