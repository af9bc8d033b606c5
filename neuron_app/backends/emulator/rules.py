"""TorchNeuron's rules, enforced on CPU tensors: the neuron code path runs here for real.

No one here can run Trainium, so the neuron backend's code path (graph keys per orientation, the tiled
VAE, warm-up and synchronize, seeding, NEFF-style cache evidence) runs on CPU tensors while this module
plays the device (the device slot and `torch.neuron` in `device.py`, the two Python modes in
`modes.py`, the cache in `cache.py`):

- Device-ness is device memory, tracked by storage (`placement.py`; no tensor subclass, no weak reference on
  a tensor): the pipeline's parameters are "on the device", factories called with `device="neuron"` and
  `.to("neuron")` put tensors there, outputs of ops on device tensors stay there, and everything else (a
  `.cpu()` copy, a tensor made without `device=`) is host memory. Device tensors report `device == neuron:0`
  (torch's PrivateUse1 slot, renamed "neuron", as TorchNeuron does). Device memory is counted against one
  logical core's HBM, weights and live activations alike.
- Every eager aten op on device tensors (outside compiled graphs) is checked against the rules below, and
  its signature (op, input shapes, dtypes) is one eager compile at first use, as in TorchNeuron's eager
  mode, looked up in memory, then in the NEFF-style folder, with TorchNeuron's persistent hit/miss counters.
  Compiled graphs run as graphs (`aot_eager`/`inductor` stand in for neuronx-cc), each with its artifact.

The rules, each a failure of the request with a message starting `neuron rule:` (sources in
docs/neuron-emulator.md): an in-place or `out=` write into a non-contiguous device tensor (`copy_` excepted:
TorchNeuron's Python `copy_` does it as a full-buffer copy); random tensors made on the device; dynamic shapes
or float64 in a compiled graph; an op mixing device and host tensors; `.numpy()` of a device tensor; a host
tensor handed to a compiled device graph; device memory past the HBM of one logical core; a failure
latched by the device (`latch`), raised at the next `synchronize()` or device op. Recorded, not failed: ops
with no Neuron kernel (a CPU fallback with a host round trip, listed by `fallback_ops` like
`torch_neuronx.get_fallback_ops()`), float64 eager ops (a CPU fallback too), int64 device ops (converted:
the device has no int64), and per compiled graph whether its attention takes the NKI kernel.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from neuron_app.backends.emulator import lifecycle
from neuron_app.backends.emulator.cache import ArtifactStore
from neuron_app.backends.emulator.cores import hbm_per_core_gib
from neuron_app.backends.emulator.device import (
    _MIXED_OK,
    _NO_KERNEL,
    _RANDOM_OPS,
    _TRANSFER_OPS,
    _register_device,
    _spec,
    shard_report,
)
from neuron_app.backends.emulator.modes import _dtypes_as_on_neuron, _PlacementMode, _returns_view, _RulesMode
from neuron_app.backends.emulator.numbering import STATE, meshes_on_host
from neuron_app.backends.emulator.placement import DeviceMemory, OnDevice
from neuron_app.backends.emulator.standin import named_failure
from neuron_app.errors import NeuronRuleViolation

log = logging.getLogger(__name__)

#: Ops with no Neuron kernel: TorchNeuron runs them on the CPU (its catch-all fallback), a host round trip each.
#: `scatter_.src` from a third-party Trn2 measurement (diffusers' latent unpack uses it); extend with
#: NEURON_EMULATOR_UNIMPLEMENTED (comma-separated `name.overload`).
UNIMPLEMENTED_OPS = frozenset({"scatter_.src"})
#: TorchNeuron's text for a copy between two NeuronCores (`csrc/utils/CopyUtils.cpp`, `copy_neuron_to_neuron`).
CROSS_CORE_MESSAGE = "Device-to-device copy requires tensors on same Neuron core"
#: Ops that write a strided view as a full-buffer copy on TorchNeuron instead of failing.
_STRIDED_WRITE_OK = {"copy_"}


def _unimplemented() -> frozenset[str]:
    extra = {x.strip() for x in os.environ.get("NEURON_EMULATOR_UNIMPLEMENTED", "").split(",") if x.strip()}
    return UNIMPLEMENTED_OPS | extra


class NeuronEmulator(OnDevice):
    """The device's state in this process: which tensors live on it, what compiled, what broke a rule."""

    def __init__(self, folder: Path, mode: str = "enforce", hbm_gib: float | None = None) -> None:
        _register_device()
        lifecycle.register()  # TorchNeuron's fork rule (`lifecycle.py`)
        self.mode = mode
        self.store = ArtifactStore(folder)
        self.eager_compiles = 0  # new eager signatures met by this process (persistent misses)
        self.eager_seen = 0  # eager device ops run (hits and compiles)
        self.graph_compiles = 0
        self.violations: list[str] = []
        self.violation_count = 0
        self.fallback_ops: dict[str, int] = {}  # op -> invocations on the CPU
        self.host_round_trips = 0  # device -> host -> device copies the fallbacks cost
        self.int64_ops = 0  # eager device ops on int64 tensors (the device converts them)
        self.strided_copies = 0  # copy_ into a strided device view: a full-buffer copy on TorchNeuron
        self.graph_attention: list[dict[str, Any]] = []  # per compiled graph: its SDPA calls and the NKI gate
        self.graph_notes: list[str] = []
        self.hbm_bytes = int((hbm_gib if hbm_gib is not None else hbm_per_core_gib()) * 2**30)
        self.memory = DeviceMemory(self.hbm_bytes)  # placement by storage, and the HBM it takes
        self.tensor_parallel: dict[str, Any] | None = None  # the adopted DTensor parameters (`shard_report`)
        self.unimplemented = _unimplemented()
        self._latched: str | None = None
        self._lock = threading.Lock()

    # --- placement (its queries: `placement.OnDevice`) ---------------------------------------------
    def place(self, value: Any, on_device: bool, weight: bool = False, index: int | None = None) -> Any:
        """Put every tensor in `value` on device `index` (default the current device; its storage: HBM it takes
        from now on, past its bank's capacity an out-of-memory failure) or take it off. A tensor on the device
        stays where it is."""
        if on_device:
            lifecycle.use()  # the first device use starts the runtime; a forked child's is refused
        where = STATE.current() if index is None else index
        placed = False
        for leaf in pytree.tree_leaves(value):
            if not isinstance(leaf, torch.Tensor):
                continue
            if not on_device:
                self.memory.release(leaf)
                continue
            over = self.memory.claim(leaf, weight, force=self.mode != "enforce", index=where)
            if over is not None:
                self._out_of_memory(leaf, *over, weight=weight, index=where)
            placed = True
        if placed and where != STATE.current():
            STATE.set_current(where)  # TorchNeuron: every allocation on neuron:N makes N current (`current-device`)
        return value

    def refuse_cross_core(self, src: int, dst: int, what: str) -> None:
        """A copy between two NeuronCores: TorchNeuron's `copy_neuron_to_neuron` checks both indices are equal
        (`CopyUtils.cpp`), and its own test expects the failure; with the app's fail-fast fallback setting it is
        a RuntimeError. The host route (`x.cpu().to("neuron:N")`) is a read and a write, allowed."""
        self.violate(
            f"{CROSS_CORE_MESSAGE} ({what}: neuron:{src} -> neuron:{dst}; TorchNeuron's copy_neuron_to_neuron refuses "
            f"a copy between two cores: go through the host, x.cpu().to('neuron:{dst}'))"
        )

    def _out_of_memory(self, leaf: torch.Tensor, asked: int, in_use: int, weight: bool, index: int = 0) -> None:
        """The Neuron runtime's allocation failure ("Failed to allocate N bytes on DEVICE for tensor", with the
        core's utilization: aws-neuron-sdk issue 1014; the bank's cores at LNC=1, AWS's device-memory page)."""
        gib, core, bank = 2**30, STATE.core(index), STATE.bank_cores(index)
        shared = f"; LNC size is 1. Neuron Cores using this HBM: NC {bank[0]} and NC {bank[1]}" if len(bank) > 1 else ""
        hint = (
            f"device weights {self.memory.weights / gib:.2f} GiB: shard the model (tensor parallel) or use LNC=2"
            if weight
            else f"weights {self.memory.weights / gib:.2f} GiB, the rest live activations: a smaller shape or batch"
        )
        self.violate(
            f"out of device memory: Failed to allocate {asked} bytes on DEVICE for tensor {_spec(leaf)} on NC {core} "
            f"(neuron:{index}){shared}; in use {in_use} bytes ({in_use / gib:.2f} GiB), capacity {self.hbm_bytes} "
            f"bytes ({self.hbm_bytes / gib:.2f} GiB of HBM per bank, NEURON_EMULATOR_HBM_GIB); {hint}"
        )

    def adopt(self, module: Any, index: int | None = None) -> int:
        """Put a module's parameters and buffers on the device (the `pipe.to("neuron")` of the real path): their
        storages become device memory, counted as weights on device `index` (None: the current device, and what is
        on the device already stays where it is; an index: moved there), and must fit the bank's HBM."""
        tensors = [*module.parameters(), *module.buffers()]
        moved = [t for t in tensors if not self.is_device(t) or (index is not None and self.index_of(t) != index)]
        for t in tensors:
            if index is not None and self.index_of(t) not in (None, index):
                self.memory.release(t)  # `.to("neuron:N")` of a module on another core: its weights move
            self.place(t, True, weight=True, index=index)
        shards = shard_report(module.parameters())
        if shards is not None:
            with self._lock:
                self.tensor_parallel = shards
        return len(moved)

    # --- rules -----------------------------------------------------------------------------------
    def violate(self, text: str) -> None:
        message = f"neuron rule: {text}"
        with self._lock:
            self.violation_count += 1
            self.violations = [*self.violations[-19:], message]
        log.error("%s", message)
        if self.mode == "enforce":
            raise NeuronRuleViolation(message)

    def latch(self, text: str) -> None:
        """An asynchronous device failure (a NEFF that failed to compile or run): it is raised by the next
        `synchronize()` or device op, not by the call that caused it, as TorchNeuron latches errors."""
        with self._lock:
            self._latched = f"neuron rule: a latched device error surfaced here: {text}"

    def raise_latched(self) -> None:
        lifecycle.use()
        with self._lock:
            message, self._latched = self._latched, None
        if message is not None:
            with self._lock:
                self.violation_count += 1
                self.violations = [*self.violations[-19:], message]
            raise NeuronRuleViolation(message)

    def synchronize(self) -> None:
        """`torch.neuron.synchronize()`: where an asynchronous failure surfaces."""
        self.raise_latched()

    def _fallback(self, name: str, round_trip: bool = False) -> None:
        with self._lock:
            self.fallback_ops[name] = self.fallback_ops.get(name, 0) + 1
            self.host_round_trips += int(round_trip)

    def fallback_invocations(self) -> list[str]:
        """Every op that ran on the CPU, once per invocation, as `torch_neuronx.get_fallback_ops()` lists them."""
        with self._lock:
            return [name for name, n in sorted(self.fallback_ops.items()) for _ in range(n)]

    def check_op(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> None:
        """The rules for one eager aten op that touches the device, then its eager compile (first use only)."""
        self.raise_latched()
        name = func._schema.name.split("::")[-1]
        overload = f"aten.{name}.{func._overloadname}"
        shapes = ", ".join(_spec(t) for t in tensors)
        for index, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[index] if index < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for target in value if isinstance(value, (list, tuple)) else [value]:
                if not (self.is_device(target) and not target.is_contiguous()):
                    continue
                if name in _STRIDED_WRITE_OK:
                    with self._lock:
                        self.strided_copies += 1
                    continue
                self.violate(
                    f"{overload} writes in place into a non-contiguous device tensor "
                    f"{tuple(target.shape)} strides {target.stride()} (TorchNeuron: 'Cannot process "
                    f"non-contiguous tensors'); inputs {shapes}"
                )
        if name in _RANDOM_OPS:
            self.violate(f"{overload} makes random numbers on the device; use a CPU generator ({shapes})")
        if name in _TRANSFER_OPS:
            indices = sorted({i for i in map(self.index_of, tensors) if i is not None})
            if len(indices) > 1:  # `dst.copy_(src)` with the two on different cores
                self.refuse_cross_core(indices[-1], indices[0], overload)
            return
        if name not in _MIXED_OK:
            host = [t for t in tensors if self.is_host(t) and t.dim() > 0]
            indices = sorted({i for i in map(self.index_of, tensors) if i is not None})
            if host:  # torch's own device check, as TorchNeuron (any accelerator) raises it
                self.violate(
                    f"Expected all tensors to be on the same device, but found at least two devices, "
                    f"neuron:{indices[0] if indices else 0} and cpu! ({overload} mixes device and host tensors: host "
                    f"{', '.join(_spec(t) for t in host)}; all {shapes}; move them to one side first)"
                )
            elif len(indices) > 1:  # two NeuronCores: torch's same check, between two device indices
                self.violate(
                    f"Expected all tensors to be on the same device, but found at least two devices, "
                    f"neuron:{indices[0]} and neuron:{indices[1]}! ({overload} mixes tensors of two NeuronCores; "
                    f"all {shapes}; move them to one core first with .to('neuron:N'))"
                )
        if name in _NO_KERNEL or (func._schema.returns and _returns_view(func)):
            return
        if f"{name}.{func._overloadname}" in self.unimplemented:
            self._fallback(f"aten::{name}.{func._overloadname}", round_trip=True)
            return
        if any(t.dtype == torch.float64 for t in tensors):
            self._fallback(f"{overload} (float64)")
            return
        if any(t.dtype == torch.int64 and self.is_device(t) for t in tensors):
            with self._lock:
                self.int64_ops += 1
        self.eager_seen += 1
        if self.store.record("eager", f"{overload}({shapes})"):
            log.debug("eager compile: %s(%s)", overload, shapes)
            with self._lock:
                self.eager_compiles += 1

    def check_graph(self, gm: Any, example_inputs: list[Any], component: str = "transformer") -> None:
        """Before a graph goes to the stand-in compiler: static shapes and no float64, the NKI attention gate,
        then its NEFF-style artifact (memory, then disk); convolutions summed as the TensorEngine does (standin.py)."""
        from neuron_app.backends.emulator.standin import lower_convolutions
        from neuron_app.backends.nki_gate import attentions, summary

        self.raise_latched()
        dynamic = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.SymInt)]
        dynamic += [
            i
            for i, x in enumerate(example_inputs)
            if isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)
        ]
        if dynamic:
            self.violate(
                f"a compiled graph has dynamic shapes (inputs {sorted(set(dynamic))}): the neuron backend rejects "
                "dynamic=True and mark_dynamic (AWS: 'dynamic=True is rejected during compilation'); with the default "
                "dynamic (or dynamic=False) each new shape recompiles as a graph of its own"
            )
        for node in gm.graph.nodes:
            val = node.meta.get("example_value", node.meta.get("val"))
            if isinstance(val, torch.Tensor) and val.dtype == torch.float64:
                self.violate(
                    f"a compiled graph computes in float64 ({node.target}): NeuronCores have no FP64 and "
                    "neuronx-cc refuses it; cast to float32 (diffusers does, on the neuron device)"
                )
                break
        found = attentions(gm)
        why = next((a.why_not for a in found if not a.nki), "")
        with self._lock:
            entry = {"graph": len(self.graph_attention), "sdpa": len(found), "nki": summary(found), "why_not": why}
            self.graph_attention.append(entry)
        inputs = ", ".join(_spec(x) for x in example_inputs)
        if self.store.record("graph", f"{gm.code}\n{inputs}"):
            with self._lock:
                self.graph_compiles += 1
        lower_convolutions(gm)

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
            self.raise_latched()
            index = STATE.current()  # TorchNeuron's executor: `device_id = torch.neuron.current_device()`
            for leaf in pytree.arg_tree_leaves(*args, **kwargs):
                if self.is_host(leaf) and leaf.dim() > 0:
                    self.violate(f"host tensor {_spec(leaf)} passed to the compiled device graph {name}")
                elsewhere = self.index_of(leaf)
                if elsewhere is not None and elsewhere != index:
                    self.violate(
                        f"the compiled device graph {name} runs on the current device neuron:{index} (TorchNeuron's "
                        f"executor takes torch.neuron.current_device(), which every allocation moves), but its input "
                        f"{_spec(leaf)} is on neuron:{elsewhere}: make its core current first (torch.neuron.set_device "
                        f"or `with torch.neuron.device({elsewhere})`)"
                    )
            with _disable_current_modes(), torch._C.DisableTorchFunction(), _dtypes_as_on_neuron(), meshes_on_host():
                try:
                    out = fn(*args, **kwargs)
                except Exception as exc:  # the stand-in compiler's own failure is named as such (standin.py)
                    named = named_failure(exc, fn, args, kwargs, name)
                    if named is exc:
                        raise
                    raise named from exc
            return self.place(out, True, index=index)  # its outputs are allocated on the current device

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
                "cache": dict(self.store.stats),
                "fallback_ops": dict(self.fallback_ops),
                "host_round_trips": self.host_round_trips,
                "int64_ops": self.int64_ops,
                "strided_copies": self.strided_copies,
                "weight_gib": round(self.memory.weights / 2**30, 3),
                "hbm_in_use_gib": round(self.memory.in_use / 2**30, 3),
                "hbm_peak_gib": round(self.memory.peak / 2**30, 3),
                "tensor_parallel": dict(self.tensor_parallel) if self.tensor_parallel else None,
                "hbm_gib": round(self.hbm_bytes / 2**30, 3),
                "devices": self.devices(),
                "graph_attention": [dict(a) for a in self.graph_attention[-50:]],
                "graph_notes": list(self.graph_notes),
            }
