"""CUDA GPUs: same compile path as CPU (inductor), bfloat16 weights."""

from __future__ import annotations

from neuron_app.backends.base import DeviceBackend


class CudaBackend(DeviceBackend):
    name = "cuda"
    default_dtype = "bfloat16"
    dist_backend = "nccl"

    def is_available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def memory_stats(self) -> dict[str, float]:
        import torch

        return {"cuda_max_allocated_gb": torch.cuda.max_memory_allocated() / 2**30}
