"""The emulated `neuron` device itself: torch's PrivateUse1 slot renamed, `torch.neuron`, the op tables.

Split from `emulator.py` (the rules) so that `emulate` can install the device without the rules' state.
"""

from __future__ import annotations

from typing import Any

import torch

from neuron_app.backends.emulator.numbering import STATE, _str_index
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
    """`torch.neuron` as TorchNeuron's module has it (`torch_neuronx/__init__.py`), as far as scripts and torch ask:
    the devices (`numbering.py`: one per held NeuronCore), the memory functions, synchronize. No real device, so
    nothing of torch's accelerator machinery (streams, events) is used; the emulator is the device.

    In the app it says "not available" (the app never asks it); `python -m neuron_app emulate` turns it on, so
    that a user's script that checks for Neuron runs."""

    emulated = True  # not TorchNeuron's module: backends/neuron.py must not take it for an installed SDK
    available = False
    synchronize_hook: Any = None  # the emulator's synchronize (latched errors), under `emulate`
    memory: Any = None  # the emulator's DeviceMemory, under `emulate`

    @classmethod
    def is_available(cls) -> bool:
        return cls.available

    @classmethod
    def device_count(cls) -> int:
        return STATE.count() if cls.available else 0

    @staticmethod
    def current_device() -> int:
        return STATE.current()

    @staticmethod
    def set_device(device: Any) -> None:
        """TorchNeuron's Python `set_device`: an index past the cores held is a ValueError ("Invalid device id")."""
        from neuron_app.backends.emulator import lifecycle

        lifecycle.use()  # the device is touched (a torchrun rank before init_process_group: refused there)
        index = device if isinstance(device, int) and not isinstance(device, bool) else None
        if index is None:
            index = getattr(device, "index", None) if not isinstance(device, str) else _str_index(device)
        STATE.set_current(STATE.checked_by_python(STATE.current() if index is None else index))

    @classmethod
    def device(cls, device: Any) -> Any:
        """`with torch.neuron.device(i):` the current device is i inside, the previous one after."""
        return _CurrentDevice(cls, device)

    @staticmethod
    def manual_seed(seed: int) -> None:
        """TorchNeuron seeds its device generator; random numbers made on the device are refused here anyway
        (`random-on-device`), so only the seed is kept."""
        _DeviceModule.seed_value = int(seed)

    manual_seed_all = manual_seed
    seed_value: int | None = None

    @classmethod
    def current_stream(cls, device: Any = None) -> Any:
        """The device's default stream (TorchNeuron's NeuronStream): `synchronize()` waits for the device."""
        return _Stream(cls, cls._index(device))

    @classmethod
    def is_initialized(cls) -> bool:
        return cls.available

    @classmethod
    def synchronize(cls, device: Any = None) -> None:
        if device is not None:
            STATE.resolve(device)  # an index past the cores held fails as TorchNeuron's guard does
        if cls.synchronize_hook is not None:
            cls.synchronize_hook()

    # --- memory (TorchNeuron exports these; torch.accelerator's ask them too: `numbering.py`) -----------------
    @classmethod
    def _index(cls, device: Any) -> int:
        return STATE.current() if device is None else STATE.resolve(device)

    @classmethod
    def memory_allocated(cls, device: Any = None) -> int:
        """Bytes of the device's memory held by live tensors of this process (the emulator's account)."""
        return cls.memory.in_use_of(cls._index(device)) if cls.memory is not None else 0

    @classmethod
    def max_memory_allocated(cls, device: Any = None) -> int:
        return cls.memory.peak_of(cls._index(device)) if cls.memory is not None else 0

    @classmethod
    def reset_peak_memory_stats(cls, device: Any = None) -> None:
        if cls.memory is not None:
            cls.memory.reset_peak(cls._index(device))

    # No caching allocator is emulated: what is reserved is what is allocated.
    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated
    reset_accumulated_memory_stats = reset_peak_memory_stats

    @classmethod
    def memory_stats(cls, device: Any = None) -> dict[str, int]:
        now, peak = cls.memory_allocated(device), cls.max_memory_allocated(device)
        return {
            "allocated_bytes.all.current": now,
            "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": now,
            "reserved_bytes.all.peak": peak,
        }

    @staticmethod
    def empty_cache() -> None:
        """Nothing cached to free: every storage is freed when it dies."""

    @classmethod
    def get_device_properties(cls, device: Any = None) -> Any:
        """`name` and `total_memory` (the bank's HBM), as TorchNeuron's properties object has them."""
        from types import SimpleNamespace

        index = cls._index(device)
        total = cls.memory.capacity if cls.memory is not None else 0
        return SimpleNamespace(name=f"NeuronCore {STATE.core(index)} (emulated)", total_memory=total, index=index)


class _CurrentDevice:
    """`torch.neuron.device(i)`: sets the thread's current device for the block and restores it."""

    def __init__(self, module: Any, device: Any) -> None:
        self.module, self.device, self.previous = module, device, None

    def __enter__(self) -> None:
        self.previous = STATE.current()
        self.module.set_device(self.device)

    def __exit__(self, *exc: Any) -> None:
        STATE.set_current(self.previous)


class _Stream:
    """A device's stream, as far as scripts ask it: its device, `synchronize()`, `query()`."""

    def __init__(self, module: Any, index: int) -> None:
        self.module, self.device_index = module, index
        self.device = torch.device(DEVICE_TYPE, index)

    def synchronize(self) -> None:
        self.module.synchronize(self.device_index)

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: Any) -> None:
        """One stream per device here: nothing runs beside it."""


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


def register_accelerator() -> None:
    """Make the emulated device torch's current accelerator (`torch._C._get_accelerator()`, one device), with
    torch's Python stand-ins for PrivateUse1's hooks: c10d asks them (a barrier, a collective on a neuron process
    group), and diffusers' tensor parallelism reads the accelerator and its device count to place each rank."""
    from torch.utils import backend_registration as registration

    _register_device()
    torch._C._acc.register_python_privateuseone_hook(registration._DummyPrivateUse1Hook())
    torch._C._acc.register_python_privateuseone_device_guard(registration._DummyDeviceGuard())


def register_dist_backend() -> None:
    """The `neuron` torch.distributed backend, over gloo: `init_process_group(backend="neuron")` and
    `DeviceMesh("neuron", ...)` work on CPU."""
    import torch.distributed as dist

    from neuron_app.backends.emulator.numbering import on_process_group, track_meshes

    track_meshes()
    if "neuron" not in dist.Backend.backend_list:

        def gloo_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
            from neuron_app.backends.emulator import lifecycle

            on_process_group()  # TorchNeuron's numbering from here: the rank's core is neuron:<local rank>
            lifecycle.start_deferred()  # the rank takes its cores now (`emulate`: NEURON_RT_VISIBLE_CORES as set)
            return dist.ProcessGroupGloo(store, rank, size, timeout)

        dist.Backend.register_backend("neuron", gloo_group, devices=["neuron", "cpu"])


def _is_neuron(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == DEVICE_TYPE
    if isinstance(device, str):
        return device.split(":")[0] == DEVICE_TYPE
    if isinstance(device, int) and not isinstance(device, bool):
        try:  # an index names the current accelerator (`torch.neuron.current_device()` gives one)
            return torch.device(device).type == DEVICE_TYPE
        except RuntimeError:
            return False
    return False


def _is_device_arg(value: Any) -> bool:
    """A positional argument of `.to(...)` that names a device (a string, a torch.device or an index)."""
    return isinstance(value, (str, torch.device)) or (isinstance(value, int) and not isinstance(value, bool))


def local_part(value: Any) -> Any:
    """A DTensor's local shard (what this rank's device holds); any other value as it is."""
    local = getattr(value, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else value


def _spec(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = local_part(value)  # a rank compiles for its own shard's shape
        return f"{tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def shard_report(params: Any) -> dict[str, Any] | None:
    """Tensor parallelism as this rank holds it: its DTensor parameters, and the share of the sharded ones' elements
    that is here (1/N on a mesh of N when every rank holds a slice); None when no parameter is a DTensor."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor, Shard

    seen: dict[int, Any] = {id(p): p for p in params if isinstance(p, DTensor)}
    if not seen:
        return None
    sharded = [p for p in seen.values() if any(isinstance(x, Shard) for x in p.placements)]
    mesh = next(iter(seen.values())).device_mesh
    local = sum(p._local_tensor.numel() for p in sharded)
    total = sum(p.numel() for p in sharded)
    return {
        "mesh": f"{mesh.device_type} x{mesh.size()}",
        "sharded": len(sharded),
        "replicated": len(seen) - len(sharded),
        "local_elements": local,
        "elements": total,
        "share": round(local / total, 4) if total else 0.0,
    }
