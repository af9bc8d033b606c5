"""The emulated `neuron` device itself: torch's PrivateUse1 slot renamed, `torch.neuron`, the op tables.

Split from `emulator.py` (the rules) so that `emulate` can install the device without the rules' state.
"""

from __future__ import annotations

from typing import Any

import torch

from neuron_app.errors import NeuronRuleViolation

DEVICE_TYPE = "neuron"
#: The emulated device, as device tensors report it.
DEVICE: torch.device | None = None  # set by `_register_device`

_RANDOM_FUNCTIONS = {
    "randn",
    "rand",
    "randint",
    "randperm",
    "randn_like",
    "rand_like",
    "randint_like",
    "normal",
    "bernoulli",
    "multinomial",
    "poisson",
}
_RANDOM_OPS = {
    "normal",
    "normal_",
    "uniform_",
    "bernoulli",
    "bernoulli_",
    "random_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "randn",
    "rand",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "multinomial",
    "poisson",
    "native_dropout",
}
#: Host <-> device transfers: DMA, not compiled kernels, and allowed to mix the two sides.
_TRANSFER_OPS = {"copy_", "_to_copy", "_foreach_copy_", "copy", "lift_fresh", "lift_fresh_copy", "_copy_from"}
#: Ops that take host index tensors on accelerators (the index is moved with the op).
_MIXED_OK = {"index", "index_put_", "index_put", "_index_put_impl_"}
#: Metadata-only ops: no kernel, nothing to compile.
_NO_KERNEL = {"detach", "alias", "view", "_unsafe_view", "t", "expand", "permute", "transpose", "unsqueeze", "squeeze"}


class _DeviceModule:
    """`torch.neuron` as far as torch itself asks (torch.accelerator, dynamo's stream state): no real device, so
    nothing of torch's accelerator machinery (streams, events) is used; the emulator is the device.

    In the app it says "not available" (the app never asks it); `python -m neuron_app emulate` turns it on, so
    that a user's script that checks for Neuron runs: one core per process, the torchrun rank's."""

    emulated = True  # not TorchNeuron's module: backends/neuron.py must not take it for an installed SDK
    available = False
    synchronize_hook: Any = None  # the emulator's synchronize (latched errors), under `emulate`

    @classmethod
    def is_available(cls) -> bool:
        return cls.available

    @classmethod
    def device_count(cls) -> int:
        return 1 if cls.available else 0

    @staticmethod
    def current_device() -> int:
        return 0  # one visible core per process: under torchrun, the rank's (TorchNeuron maps LOCAL_RANK)

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @classmethod
    def is_initialized(cls) -> bool:
        return cls.available

    @classmethod
    def synchronize(cls, device: Any = None) -> None:
        if cls.synchronize_hook is not None:
            cls.synchronize_hook()


_DEVICE_MODULE = _DeviceModule()


def _register_device() -> torch.device:
    """Name torch's PrivateUse1 slot "neuron", as TorchNeuron does, so `torch.device("neuron", 0)` exists, and
    give torch its device module (again, if a test's FAKE SDK replaced it meanwhile)."""
    global DEVICE
    if DEVICE is None:
        name = torch._C._get_privateuse1_backend_name()
        if name == "privateuseone":
            torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        elif name != DEVICE_TYPE:
            raise NeuronRuleViolation(f"neuron rule: torch's PrivateUse1 device is already {name!r}, not neuron")
        DEVICE = torch.device(DEVICE_TYPE, 0)
    if getattr(torch, DEVICE_TYPE, None) is not _DEVICE_MODULE:
        setattr(torch, DEVICE_TYPE, _DEVICE_MODULE)
    return DEVICE


def _is_neuron(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == DEVICE_TYPE
    if isinstance(device, str):
        return device.split(":")[0] == DEVICE_TYPE
    return False


def _spec(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__
