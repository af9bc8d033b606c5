"""CUDA GPUs: same compile path as CPU (inductor), bfloat16 weights."""

from __future__ import annotations

import glob
import os

from neuron_app.backends.base import DeviceBackend


def _nvidia_driver_present() -> bool:
    """A torch-free first look: no NVIDIA driver, no CUDA device (so `auto` need not import torch to say no)."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


class CudaBackend(DeviceBackend):
    name = "cuda"
    default_dtype = "bfloat16"
    dist_backend = "nccl"

    def is_available(self) -> bool:
        if not _nvidia_driver_present():  # importing torch costs seconds before the page can answer
            return False
        import torch

        return torch.cuda.is_available()

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def device_for(self, index: int = 0) -> str:
        return f"cuda:{index}"

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()
