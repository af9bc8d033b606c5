"""TorchNeuron's rules, enforced on CPU tensors: the neuron code path runs here for real.

No one here can run Trainium, so the neuron backend's code path (graph keys per orientation, the tiled
VAE, warm-up and synchronize, seeding, NEFF-style cache evidence) runs on CPU tensors while this module
plays the device:

- Device-ness is tracked per tensor (a weak identity map, no tensor subclass): the pipeline's parameters
  are "on the device", factories called with `device="neuron"` and `.to("neuron")` put tensors there,
  outputs of ops on device tensors stay there, and `.cpu()` gives an unmarked host copy. Device tensors
  report `device == neuron:0` (torch's PrivateUse1 slot, renamed "neuron", as TorchNeuron does), so the
  pipeline's own `device.type` branches run as on Trainium.
- Every eager aten op on device tensors (outside compiled graphs) is checked against the rules below, and
  its signature (op, input shapes, dtypes) is one eager compile at first use, as in TorchNeuron's eager
  mode, remembered as a file in the NEFF-style cache folder (`<dir>/ab/cd/<32 hex>.neff`): it survives a
  restart, as NEFFs do. Compiled graphs run as graphs (`aot_eager`/`inductor` stand in for neuronx-cc),
  each with its own artifact there.

The rules, each a failure of the request with a message starting `neuron rule:` (sources in
docs/neuron-emulator.md): an in-place or `out=` write into a non-contiguous device tensor; random tensors
made on the device; dynamic shapes in a compiled graph; an op mixing device and host tensors; `.numpy()`
of a device tensor; a host tensor handed to a compiled device graph. Modelled as a CPU fallback (listed by
`fallback_ops`, like `torch_neuronx.get_fallback_ops()`), not a failure: float64 ops (NeuronCores have
no FP64 units).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from neuron_app.errors import NeuronRuleViolation

log = logging.getLogger(__name__)

DEVICE_TYPE = "neuron"
#: The emulated device, as device tensors report it.
DEVICE = None  # set by `_register_device`

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
    nothing of torch's accelerator machinery (streams, events) is used; the emulator is the device."""

    emulated = True  # not TorchNeuron's module: backends/neuron.py must not take it for an installed SDK

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


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


class ArtifactStore:
    """NEFF-style files, one per compiled graph or eager-op signature: `<dir>/ab/cd/<32 hex>.neff`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._known: set[str] | None = None
        self._lock = threading.Lock()

    def _load(self) -> set[str]:
        if self._known is None:
            self._known = {p.stem for p in self.folder.rglob("*.neff")} if self.folder.is_dir() else set()
        return self._known

    def record(self, kind: str, signature: str) -> bool:
        """Remember `signature`; True when it is new (a compile), False when it was there (a cache hit)."""
        key = hashlib.sha256(f"{kind}\n{signature}".encode()).hexdigest()[:32]
        with self._lock:
            known = self._load()
            if key in known:
                return False
            known.add(key)
        path = self.folder / key[:2] / key[2:4] / f"{key}.neff"
        if path.exists():  # another process compiled it meanwhile
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp.{os.getpid()}.{threading.get_ident()}.{path.name}")
        tmp.write_text(json.dumps({"kind": kind, "signature": signature, "emulated": True}))
        os.replace(tmp, path)
        return True

    def count(self) -> int:
        with self._lock:
            return len(self._load())


class NeuronEmulator:
    """The device's state in this process: which tensors live on it, what compiled, what broke a rule."""

    def __init__(self, folder: Path, mode: str = "enforce") -> None:
        _register_device()
        self.mode = mode
        self.store = ArtifactStore(folder)
        self.device_tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.host_tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.eager_compiles = 0  # new eager signatures met by this process
        self.eager_seen = 0  # eager device ops run (hits and compiles)
        self.graph_compiles = 0
        self.violations: list[str] = []
        self.violation_count = 0
        self.fallback_ops: dict[str, int] = {}
        self.graph_notes: list[str] = []
        self._lock = threading.Lock()

    # --- placement -------------------------------------------------------------------------------
    def is_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.device_tensors

    def is_host(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.host_tensors

    def place(self, value: Any, on_device: bool) -> Any:
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                if on_device:
                    self.device_tensors[leaf] = True
                    self.host_tensors.pop(leaf, None)
                else:
                    self.host_tensors[leaf] = True
                    self.device_tensors.pop(leaf, None)
        return value

    def adopt(self, module: Any) -> int:
        """Put a module's parameters and buffers on the device (the `pipe.to("neuron")` of the real path)."""
        n = 0
        for tensor in [*module.parameters(), *module.buffers()]:
            self.device_tensors[tensor] = True
            n += 1
        return n

    # --- rules -----------------------------------------------------------------------------------
    def violate(self, text: str) -> None:
        message = f"neuron rule: {text}"
        with self._lock:
            self.violation_count += 1
            self.violations = [*self.violations[-19:], message]
        log.error("%s", message)
        if self.mode == "enforce":
            raise NeuronRuleViolation(message)

    def _fallback(self, name: str) -> None:
        with self._lock:
            self.fallback_ops[name] = self.fallback_ops.get(name, 0) + 1

    def check_op(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> None:
        """The rules for one eager aten op that touches the device, then its eager compile (first use only)."""
        name = func._schema.name.split("::")[-1]
        overload = f"aten.{name}.{func._overloadname}"
        shapes = ", ".join(_spec(t) for t in tensors)
        for index, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[index] if index < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for target in value if isinstance(value, (list, tuple)) else [value]:
                if self.is_device(target) and not target.is_contiguous():
                    self.violate(
                        f"{overload} writes in place into a non-contiguous device tensor "
                        f"{tuple(target.shape)} strides {target.stride()} (TorchNeuron: 'Cannot process "
                        f"non-contiguous tensors'); inputs {shapes}"
                    )
        if name in _RANDOM_OPS:
            self.violate(f"{overload} makes random numbers on the device; use a CPU generator ({shapes})")
        if name in _TRANSFER_OPS:
            return
        if name not in _MIXED_OK:
            host = [t for t in tensors if self.is_host(t) and t.dim() > 0]
            if host:
                self.violate(
                    f"{overload} mixes device and host tensors (host: {', '.join(_spec(t) for t in host)}; "
                    f"all: {shapes}); move them to one side first"
                )
        if name in _NO_KERNEL or (func._schema.returns and _returns_view(func)):
            return
        if any(t.dtype == torch.float64 for t in tensors):
            self._fallback(f"{overload} (float64)")
            return
        self.eager_seen += 1
        if self.store.record("eager", f"{overload}({shapes})"):
            log.debug("eager compile: %s(%s)", overload, shapes)
            with self._lock:
                self.eager_compiles += 1

    def check_graph(self, gm: Any, example_inputs: list[Any]) -> None:
        """Before a graph goes to the stand-in compiler: static shapes only, then its NEFF-style artifact."""
        dynamic = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.SymInt)]
        dynamic += [
            i
            for i, x in enumerate(example_inputs)
            if isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)
        ]
        if dynamic:
            self.violate(
                f"a compiled graph has dynamic shapes (inputs {sorted(set(dynamic))}): the neuron backend needs "
                "static shapes (dynamic=False, no mark_dynamic); each shape is its own graph"
            )
        for node in gm.graph.nodes:
            val = node.meta.get("example_value", node.meta.get("val"))
            if isinstance(val, torch.Tensor) and val.dtype == torch.float64:
                note = f"graph computes in float64 ({node.target}); NeuronCores have no FP64"
                if note not in self.graph_notes:
                    self.graph_notes.append(note)
                break
        inputs = ", ".join(_spec(x) for x in example_inputs)
        if self.store.record("graph", f"{gm.code}\n{inputs}"):
            with self._lock:
                self.graph_compiles += 1

    # --- running ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def device_work(self) -> Iterator[None]:
        """Run the enclosed eager work under the rules (one thread's work: modes are thread-local)."""
        _register_device()
        with _PlacementMode(self), _RulesMode(self):
            yield

    def graph(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """Run a compiled callable as one device graph: no rules inside it (dynamo refuses to trace under a
        Python mode), device-ness checked at its inputs and given to its outputs."""

        def run_graph(*args: Any, **kwargs: Any) -> Any:
            for leaf in pytree.arg_tree_leaves(*args, **kwargs):
                if self.is_host(leaf) and leaf.dim() > 0:
                    self.violate(f"host tensor {_spec(leaf)} passed to the compiled device graph {name}")
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                out = fn(*args, **kwargs)
            return self.place(out, True)

        run_graph.neuron_graph = name  # type: ignore[attr-defined]
        return run_graph

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "mode": self.mode,
                "violations": list(self.violations),
                "violation_count": self.violation_count,
                "eager_signatures": self.store.count(),
                "eager_compiles": self.eager_compiles,
                "graph_compiles": self.graph_compiles,
                "fallback_ops": dict(self.fallback_ops),
                "graph_notes": list(self.graph_notes),
            }


def _returns_view(func: Any) -> bool:
    ret = func._schema.returns[0]
    return ret.alias_info is not None and not ret.alias_info.is_write


class _RulesMode(TorchDispatchMode):
    """Sees every aten op run eagerly: checks the ones on device tensors and keeps their outputs there."""

    def __init__(self, emulator: NeuronEmulator) -> None:
        super().__init__()
        self.emulator = emulator

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        em = self.emulator
        tensors = [t for t in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        on_device = any(em.is_device(t) for t in tensors)
        if on_device:
            em.check_op(func, args, kwargs, tensors)
        out = func(*args, **kwargs)
        if on_device:
            em.place(out, True)
        elif tensors and all(em.is_host(t) for t in tensors):
            em.place(out, False)
        return out


class _PlacementMode(TorchFunctionMode):
    """Python-level placement: `device="neuron"` factories, `.to()`, `.cpu()`, `.device`, `.numpy()`."""

    def __init__(self, emulator: NeuronEmulator) -> None:
        super().__init__()
        self.emulator = emulator

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        em = self.emulator
        owner = getattr(func, "__self__", None)
        if owner is torch.Tensor.device:  # the `.device` property
            return DEVICE if em.is_device(args[0]) else torch.device("cpu")
        if owner is torch.Tensor.is_cpu:
            return not em.is_device(args[0])
        name = getattr(func, "__name__", "")
        if name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor) and _is_method(func, name):
            return self._move(func, name, args, kwargs)
        if name == "numpy" and args and em.is_device(args[0]):
            em.violate(f"Tensor.numpy() of a device tensor {_spec(args[0])}: move it to the CPU first")
        if name == "get_device" and args and em.is_device(args[0]):
            return 0
        device = kwargs.get("device")
        if _is_neuron(device):
            if name in _RANDOM_FUNCTIONS:
                em.violate(f"torch.{name}(device='neuron') makes random numbers on the device; use a CPU generator")
            out = func(*args, **{**kwargs, "device": "cpu"})
            return em.place(out, True)
        if name in _RANDOM_FUNCTIONS and any(em.is_device(a) for a in pytree.tree_leaves(args)):
            em.violate(f"torch.{name} of a device tensor makes random numbers on the device; use a CPU generator")
        out = func(*args, **kwargs)
        if device is not None and isinstance(out, torch.Tensor) and not _is_neuron(device):
            em.place(out, False)  # an explicit host factory
        elif (
            name in ("from_numpy", "tensor", "as_tensor")
            and device is None
            and isinstance(out, torch.Tensor)
            and not any(em.is_device(a) for a in pytree.tree_leaves(args))
        ):
            em.place(out, False)
        return out

    def _move(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        em = self.emulator
        src = args[0]
        if name == "cpu":
            target_device, call_kwargs = False, {}
        else:
            rest = args[1:]
            if rest and isinstance(rest[0], torch.Tensor):
                target_device = em.is_device(rest[0])
                call_kwargs = {"dtype": rest[0].dtype}
            else:
                device = kwargs.get("device")
                if device is None and rest and isinstance(rest[0], (str, torch.device)):
                    device = rest[0]
                dtype = kwargs.get("dtype")
                if dtype is None:
                    dtype = next((a for a in rest if isinstance(a, torch.dtype)), None)
                target_device = em.is_device(src) if device is None else _is_neuron(device)
                call_kwargs = {"dtype": dtype} if dtype is not None else {}
                if "memory_format" in kwargs:
                    call_kwargs["memory_format"] = kwargs["memory_format"]
        out = src.to(**call_kwargs) if call_kwargs else src
        if out is src and target_device != em.is_device(src):
            out = src.clone()  # a transfer makes a new tensor on the other side
        return em.place(out, target_device)


def _is_method(func: Any, name: str) -> bool:
    return func is getattr(torch.Tensor, name, None) or getattr(func, "__qualname__", "").endswith(f"Tensor.{name}")
