"""The emulated devices as TorchNeuron numbers them: `neuron:N` is the N-th NeuronCore this process holds.

TorchNeuron (`torch_neuronx/csrc/core/NeuronDevice.cpp`, in the code index): `device_count()` is the logical cores
the runtime gave the process (`nrt_get_visible_vnc_count`); the current device is per thread, 0 unless
`set_device` (the process default is the first one set); an index past them fails in `set_device`, which the
device guard calls for every `neuron:N` ("Device index N is out of range. Valid range is 0 to M for this
process"). After `init_process_group(backend="neuron")` a rank holds one core and its device index is its local
rank: `device_count()` is the local world size and only `neuron:<local rank>` is valid.

At `NEURON_LOGICAL_NC_CONFIG=1` two neighbouring cores share one HBM bank (AWS, Logical NeuronCore configuration:
"both physical NeuronCores have access to the entire 24GB HBM bank"); `bank()` says which bank an index uses.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class DeviceState:
    """This process's devices: the cores it holds, the distributed offset, the current device of each thread."""

    def __init__(self) -> None:
        self.cores: list[int] = [0]  # the logical NeuronCores held, in index order (the runtime's, cores.py)
        self.lnc = 2
        self.start = 0  # distributed: this rank's device index (its local rank)
        self.local_world_size: int | None = None
        self._thread = threading.local()
        self._default: int | None = None

    def hold(self, cores: list[int], lnc: int = 2) -> None:
        """The cores the runtime gave this process (`cores.acquire()`), and the LNC they were counted at."""
        self.cores, self.lnc = list(cores) or [0], lnc

    def distributed(self, local_rank: int, local_world_size: int) -> None:
        """`init_process_group(backend="neuron")`: the rank's one core is `neuron:<local rank>`."""
        self.start, self.local_world_size = local_rank, local_world_size
        self._default = local_rank
        self._thread.index = local_rank

    def count(self) -> int:
        return self.local_world_size if self.local_world_size is not None else len(self.cores)

    def valid(self) -> range:
        return range(self.start, self.start + len(self.cores))

    def check(self, index: int) -> int:
        """The index if this process has it, else TorchNeuron's error (`c10_neuron::set_device`)."""
        span = self.valid()
        if index not in span:
            raise RuntimeError(
                f"Device index {index} is out of range. Valid range is {span.start} to {span.stop - 1} for this "
                f"process (neuron-emulated: this process holds NeuronCore(s) {self.cores}; NEURON_RT_VISIBLE_CORES)"
            )
        return index

    def current(self) -> int:
        index = getattr(self._thread, "index", None)
        if index is not None:
            return index
        return self._default if self._default is not None else self.start

    def set_current(self, index: int) -> None:
        """The thread's current device (the first one set is the process default). TorchNeuron's
        `make_neuron_storage` calls it for every allocation on `neuron:N`, so the current device is the index of
        the last tensor this thread allocated (the review's V2); a compiled graph runs there."""
        self._thread.index = self.check(index)
        if self._default is None:
            self._default = index

    def checked_by_python(self, index: int) -> int:
        """`torch.neuron.set_device(N)` checks in Python first: TorchNeuron's `torch_neuronx/__init__.py` raises a
        ValueError with its own text, where the device guard's C++ check is a RuntimeError (`check`)."""
        span = self.valid()
        if index not in span:
            raise ValueError(
                f"Invalid device id: {index}. Valid range is {span.start} to {span.stop - 1} (neuron-emulated: this "
                f"process holds NeuronCore(s) {self.cores}; NEURON_RT_VISIBLE_CORES)"
            )
        return index

    def resolve(self, device: Any) -> int:
        """The index a device argument names (`neuron`, `neuron:1`, a torch.device, an int): checked."""
        index = device if isinstance(device, int) and not isinstance(device, bool) else None
        if index is None:
            index = getattr(device, "index", None) if not isinstance(device, str) else _str_index(device)
        return self.current() if index is None else self.check(index)

    def core(self, index: int) -> int:
        """The runtime's core number behind a device index."""
        return self.cores[index - self.start] if index - self.start < len(self.cores) else index

    def bank(self, index: int) -> int:
        """The HBM bank an index allocates from: its own at LNC=2, shared by two neighbouring cores at LNC=1."""
        core = self.core(index)
        return core // 2 if self.lnc == 1 else core

    def bank_cores(self, index: int) -> list[int]:
        return [2 * self.bank(index), 2 * self.bank(index) + 1] if self.lnc == 1 else [self.core(index)]


def _str_index(text: str) -> int | None:
    _, _, tail = text.partition(":")
    return int(tail) if tail.strip().isdigit() else None


STATE = DeviceState()


#: TorchNeuron's `_neuron_runtime_setup` (its `torch_neuronx/distributed/backend.py`), word for word.
RUNTIME_BEFORE_GROUP = "Neuron runtime should not be initialized before the init_process_group"
ONE_DEVICE_PER_RANK = "Attempted to have more than one device per process in distributed setup"


def on_process_group() -> None:
    """Called when the `neuron` process group is made, as TorchNeuron's `_neuron_runtime_setup` does it: the runtime
    must not have started (an assert there), an unset `NEURON_RT_VISIBLE_CORES` becomes the rank's `LOCAL_RANK`
    (`_set_rt_visible_cores`: only now, not at start, and only when unset, so two default groups on one instance
    both ask for cores 0..N-1), and the rank's device is `neuron:<local rank>` from here."""
    from neuron_app.backends.emulator import lifecycle
    from neuron_app.environment import VISIBLE_CORES_VAR

    if STATE.local_world_size is not None:  # a second group (a DeviceMesh's, new_group): set up once per process
        return
    if lifecycle.started():
        raise AssertionError(
            f"{RUNTIME_BEFORE_GROUP} (neuron-emulated: this process used the device before "
            "init_process_group(backend='neuron'); TorchNeuron asserts it has not)"
        )
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ and not os.environ.get(VISIBLE_CORES_VAR):
        os.environ[VISIBLE_CORES_VAR] = str(rank)
    STATE.distributed(rank, int(os.environ.get("LOCAL_WORLD_SIZE", str(rank + 1))))


# --- DeviceMesh("neuron") inside device graphs ---------------------------------------------------------------
_MESHES: weakref.WeakSet[Any] = weakref.WeakSet()
_MESH_LOCK = threading.RLock()


def track_meshes() -> None:
    """Remember every `DeviceMesh("neuron", ...)` made from now on (for `meshes_on_host`)."""
    from torch.distributed.device_mesh import DeviceMesh

    if getattr(DeviceMesh.__init__, "neuron_tracked", False):
        return
    init = DeviceMesh.__init__

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "_device_type", None) == "neuron":
            _MESHES.add(self)

    tracked.neuron_tracked = True  # type: ignore[attr-defined]
    DeviceMesh.__init__ = tracked  # type: ignore[method-assign]


@contextmanager
def meshes_on_host() -> Iterator[None]:
    """While a device graph traces and runs, every neuron DeviceMesh says `cpu`: the graph is traced on the CPU
    tensors the emulator's device memory is, and DTensor makes its metadata tensors on the mesh's device type (a
    `neuron` one would be a second device to the fake-tensor tracer: "Tensor device mismatch", the review's U2).
    Eager work keeps `neuron` (DTensor.from_local moves a local tensor to the mesh's device type)."""
    if not _MESHES:  # no tensor parallelism: nothing to switch, no lock
        yield
        return
    with _MESH_LOCK:  # one graph at a time switches them (a second thread's graph waits)
        meshes = [m for m in list(_MESHES) if getattr(m, "_device_type", None) == "neuron"]
        for mesh in meshes:
            mesh._device_type = "cpu"
        try:
            yield
        finally:
            for mesh in meshes:
                mesh._device_type = "neuron"


# --- torch.accelerator's device and memory functions ----------------------------------------------------------
# `torch.accelerator`'s device and memory functions on the emulated device, as Neuron 2.34 has them.
#
# The torch-neuronx 2.34 release notes: "The torch.accelerator memory functions ... work on Neuron". torch's own
# `torch.accelerator.memory_allocated()` etc. ask its C++ device allocator (`torch._C._accelerator_getDeviceStats`),
# which the emulated device (torch's Python stand-ins for PrivateUse1) does not have: "device_allocator INTERNAL
# ASSERT FAILED" (the review's U8). Under `python -m neuron_app emulate` those entry points answer from
# `torch.neuron` (`device.py`: the emulator's account per device index) while the accelerator is `neuron`, so
# diffusers' `backend_max_memory_allocated("neuron")` / `TorchDeviceBackend("neuron").max_memory_allocated()` run.
#: torch._C entry point -> how the emulated device answers it (`module` is `torch.neuron`, the emulator's).
_ANSWERS: dict[str, Any] = {
    "_accelerator_isAllocatorInitialized": lambda module: True,
    "_accelerator_getDeviceStats": lambda module, index=None: _stats(module, index),
    "_accelerator_resetPeakStats": lambda module, index=None: module.reset_peak_memory_stats(index),
    "_accelerator_resetAccumulatedStats": lambda module, index=None: module.reset_accumulated_memory_stats(index),
    "_accelerator_emptyCache": lambda module: module.empty_cache(),
    "_accelerator_getMemoryInfo": lambda module, index=None: _memory_info(module, index),
    "_accelerator_getDeviceIndex": lambda module: module.current_device(),
    "_accelerator_setDeviceIndex": lambda module, index: module.set_device(index),
    "_accelerator_synchronizeDevice": lambda module, index=None: module.synchronize(index),
}


def _stats(module: Any, index: Any) -> dict[str, Any]:
    """The nested form torch.accelerator.memory_stats flattens (`allocated_bytes.all.current`, ...)."""
    now, peak = module.memory_allocated(index), module.max_memory_allocated(index)
    counts = {"current": now, "peak": peak, "allocated": now, "freed": 0}
    return {"allocated_bytes": {"all": counts}, "reserved_bytes": {"all": dict(counts)}}


def _memory_info(module: Any, index: Any) -> tuple[int, int]:
    """(free, total) of the device's HBM bank, as torch.accelerator.get_memory_info gives them."""
    total = module.get_device_properties(index).total_memory
    return max(total - module.memory_allocated(index), 0), total


def install(module: Any) -> None:
    """Answer torch.accelerator's device and memory calls from the emulated `torch.neuron` while the current
    accelerator is the emulated device; anything else still goes to torch's own."""
    import torch

    for name, answer in _ANSWERS.items():
        original = getattr(torch._C, name, None)
        if original is None or getattr(original, "neuron_emulated", False):
            continue

        def entry(*args: Any, _original: Any = original, _answer: Any = answer) -> Any:
            accelerator = torch._C._accelerator_getAccelerator()
            if accelerator.type != "neuron" or not module.is_available():
                return _original(*args)
            return _answer(module, *args)

        entry.neuron_emulated = True  # type: ignore[attr-defined]
        setattr(torch._C, name, entry)
