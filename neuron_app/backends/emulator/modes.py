"""The two Python modes the emulator plays the device with: aten ops (rules) and placement (`.to`, factories).

Split from `emulator.py`; they hold no state of their own, only the emulator they report to.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from neuron_app.backends.emulator import device as dev
from neuron_app.backends.emulator import lifecycle
from neuron_app.backends.emulator.device import _RANDOM_FUNCTIONS, _is_neuron, _spec
from neuron_app.backends.emulator.numbering import STATE
from neuron_app.backends.emulator.standin import accumulate_in_float32


def _returns_view(func: Any) -> bool:
    ret = func._schema.returns[0]
    return ret.alias_info is not None and not ret.alias_info.is_write


class _RulesMode(TorchDispatchMode):
    """Sees every aten op run eagerly: checks the ones on device tensors and keeps their outputs there."""

    def __init__(self, emulator: Any) -> None:
        super().__init__()
        self.emulator = emulator

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        em = self.emulator
        tensors = [t for t in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        index = next((i for i in map(em.index_of, tensors) if i is not None), None)
        if index is not None:
            em.check_op(func, args, kwargs, tensors)
        if index is not None and func is torch.ops.aten.convolution.default:
            out = accumulate_in_float32(func, *args, **kwargs)  # as a device graph's (standin.py)
        else:
            out = func(*args, **kwargs)
        if index is not None:
            em.place(out, True, index=index)  # new storages are device memory on the inputs' core (HBM until they die)
        return out


class _PlacementMode(TorchFunctionMode):
    """Python-level placement: `device="neuron"` factories, `.to()`, `.cpu()`, `.device`, `.numpy()`."""

    def __init__(self, emulator: Any) -> None:
        super().__init__()
        self.emulator = emulator

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        em = self.emulator
        owner = getattr(func, "__self__", None)
        # The `.device` / `.is_cpu` properties: a host tensor answers for itself (a `meta` one is not on the CPU:
        # transformers materializes the buffers that say meta, such as the text encoder's RoPE frequencies).
        if owner is torch.Tensor.device:
            index = em.index_of(args[0])
            return torch.device(dev.DEVICE_TYPE, index) if index is not None else func(*args, **kwargs)
        if owner is torch.Tensor.is_cpu:
            return not em.is_device(args[0]) and func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor) and _is_method(func, name):
            return self._move(func, name, args, kwargs)
        if name == "numpy" and args and em.is_device(args[0]):
            em.violate(f"Tensor.numpy() of a device tensor {_spec(args[0])}: move it to the CPU first")
        if name == "get_device" and args and em.is_device(args[0]):
            return em.index_of(args[0])
        device = kwargs.get("device")
        if _is_neuron(device):
            lifecycle.use()  # an allocation starts the runtime (a torchrun rank's before init_process_group too)
            index = STATE.resolve(device)  # `neuron:N` past the process's cores fails as TorchNeuron's guard does
            if name in _RANDOM_FUNCTIONS:
                em.violate(f"torch.{name}(device='neuron') makes random numbers on the device; use a CPU generator")
            out = func(*args, **{**kwargs, "device": "cpu"})
            return em.place(out, True, index=index)
        if name in _RANDOM_FUNCTIONS and any(em.is_device(a) for a in pytree.tree_leaves(args)):
            em.violate(f"torch.{name} of a device tensor makes random numbers on the device; use a CPU generator")
        return func(*args, **kwargs)  # a new storage is host memory; an op on device tensors places its own

    def _move(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        em = self.emulator
        src = args[0]
        target_index = em.index_of(src)  # `.to(dtype)` keeps the core
        if name == "cpu":
            target_device, call_kwargs = False, {}
        else:
            rest = args[1:]
            if rest and isinstance(rest[0], torch.Tensor):
                target_device, target_index = em.is_device(rest[0]), em.index_of(rest[0])
                call_kwargs = {"dtype": rest[0].dtype}
            else:
                device = kwargs.get("device")
                if device is None and rest and dev._is_device_arg(rest[0]):
                    device = rest[0]
                dtype = kwargs.get("dtype")
                if dtype is None:
                    dtype = next((a for a in rest if isinstance(a, torch.dtype)), None)
                target_device = em.is_device(src) if device is None else _is_neuron(device)
                if device is not None and target_device:
                    target_index = STATE.resolve(device)
                call_kwargs = {"dtype": dtype} if dtype is not None else {}
                if "memory_format" in kwargs:
                    call_kwargs["memory_format"] = kwargs["memory_format"]
                if device is not None and not _is_neuron(device) and torch.device(device).type != "cpu":
                    call_kwargs["device"] = device  # `meta` (accelerate's offload): torch's own move
        source = em.index_of(src)
        if target_device and source is not None and target_index is not None and source != target_index:
            em.refuse_cross_core(source, target_index, f"Tensor.{name}")  # host route: x.cpu().to("neuron:N")
        with _disable_current_modes():  # a transfer or a cast, not an op the device compiles
            out = src.to(**call_kwargs) if call_kwargs else src
            moves_core = target_device and em.is_device(src) and em.index_of(src) != target_index
            if out is src and (target_device != em.is_device(src) or moves_core):
                out = src.clone()  # a transfer makes a new storage on the other side (or the other core)
        return em.place(out, True, index=target_index) if target_device else out  # a host storage is host memory


def _is_method(func: Any, name: str) -> bool:
    return func is getattr(torch.Tensor, name, None) or getattr(func, "__qualname__", "").endswith(f"Tensor.{name}")


_DTYPE_LOCK = threading.RLock()


@contextlib.contextmanager
def _dtypes_as_on_neuron() -> Iterator[None]:
    """Inside a device graph, diffusers' device-type dtype choice (`maybe_adjust_dtype_for_device`: float64 ->
    float32, int64 -> int32 on neuron) is made as on the device: the graph is traced on CPU tensors, whose
    device type would otherwise pick float64 (the RoPE frequencies), which the float64 rule then refuses."""
    try:
        from diffusers.utils import torch_utils
    except ImportError:
        yield
        return
    table = getattr(torch_utils, "_DTYPE_UNSUPPORTED_DEVICES", None)
    if not isinstance(table, dict):
        yield
        return
    with _DTYPE_LOCK:
        saved = dict(table)
        for dtype, devices in saved.items():
            table[dtype] = frozenset(devices) | {"cpu"}
        try:
            yield
        finally:
            table.clear()
            table.update(saved)
