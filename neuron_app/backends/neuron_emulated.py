"""`neuron-emulated`: the neuron backend's whole code path on CPU, under TorchNeuron's rules.

Everything the manager does differently on Neuron (graph keys per orientation, the tiled VAE by default,
the fallback switches and report, warm-up with synchronize, CPU-generator seeding, NEFF-style cache
evidence, the fingerprint) comes from `NeuronBackend` unchanged; only what needs the SDK is replaced:
tensors live on the CPU with device-ness tracked by `backends/emulator/rules.py`, and `aot_eager`/`inductor`
stand in for neuronx-cc. The fingerprint names the emulator, so an emulated cache never passes for NEFFs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from neuron_app.backends.base import CacheProbe, DeviceBackend
from neuron_app.backends.neuron import Counters, NeuronBackend, NeuronCacheProbe

#: Where emulated artifacts go: apart from real NEFFs, so one cache folder never mixes the two.
ARTIFACTS = "neff-emulated"


_memories: dict[int, Any] = {}  # HBM capacity -> this process's core memory (placement by storage)


def _core_memory(capacity: int) -> Any:
    from neuron_app.backends.emulator.placement import DeviceMemory

    if capacity not in _memories:
        _memories[capacity] = DeviceMemory(capacity)
    return _memories[capacity]


class NeuronEmulatedBackend(NeuronBackend):
    name = "neuron-emulated"
    default_dtype = "bfloat16"  # as on Trainium; dtype = "float32" where a test needs exact CPU numerics
    default_compile_backend = "aot_eager"  # seconds; inductor works too (its disk cache then holds kernels)
    dist_backend = "gloo"

    def __init__(self, rules: str = "enforce") -> None:
        super().__init__()
        self.rules = rules
        self._folder: Path | None = None
        self._emulator: Any = None
        self.cores: list[int] = []  # the NeuronCores this process holds (`check_device`)

    def configure(self, settings: Any) -> None:
        self.rules = settings.neuron_rules

    # --- no SDK, no device: always here ---------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def require(self) -> None:
        self.check_device()

    def require_sdk(self) -> None:
        return None

    def check_device(self) -> None:
        """The runtime's start: this process reserves its NeuronCores of the emulated instance, or fails in one
        line naming the core and the process holding it (`emulator/cores.py`)."""
        from neuron_app.backends.emulator import cores

        self.cores = cores.acquire()  # and they are neuron:0, neuron:1, ... from now on (emulator/numbering.py)

    def torch_device(self) -> str:
        return "cpu"  # the emulator marks what is "on the device" (adopt)

    def core_ids(self) -> list[int] | None:
        """The emulated NeuronCores this process holds: `neuron:0` is the first (`emulator/numbering.py`)."""
        return list(self.cores) or [0]

    def torch_device_at(self, index: int) -> str:
        return "cpu"  # `adopt` puts each component's storages on its core's account

    def memory_gib_per_core(self) -> float | None:
        """The emulated bank (NEURON_EMULATOR_HBM_GIB lowers it: real-size placements rehearsed on a small host)."""
        return self.emulator.hbm_bytes / 2**30

    def synchronize(self) -> None:
        """Wait for the emulated compile queue (its counters land, `emulator/cache.py`); what the emulator latched
        (an asynchronous device failure) surfaces here. One queue and one latch serve every core held: waiting
        once waits for all of them, as NeuronBackend's loop over the cores does on a device."""
        if self._emulator is not None:
            self._emulator.store.flush()
            self._emulator.synchronize()

    def current_device_index(self) -> int | None:
        from neuron_app.backends.emulator.numbering import STATE

        return STATE.current()

    def set_current_device(self, index: int) -> None:
        """The emulator runs a device graph on the current device, as TorchNeuron does (`current-device`)."""
        from neuron_app.backends.emulator.numbering import STATE

        STATE.set_current(index)

    # --- cache -----------------------------------------------------------------------------------
    def prepare_cache(self, cache_dir: Path) -> None:
        DeviceBackend.prepare_cache(self, cache_dir)  # the stand-in compiler's (inductor) folder
        self._folder = cache_dir / ARTIFACTS
        self._folder.mkdir(parents=True, exist_ok=True)

    def compiled_artifacts_dirs(self, cache_dir: Path) -> list[Path]:
        return [cache_dir / ARTIFACTS, cache_dir / "inductor"]

    def cache_probe(self, compile_backend: str, cache_dir: Path) -> CacheProbe:
        """NeuronBackend's probe, on the emulator's TorchNeuron-shaped counters (memory first, then disk)."""
        return NeuronCacheProbe(cache_dir / ARTIFACTS, counters=self.settled_counters)

    def cache_counters(self) -> Counters | None:
        return self.emulator.store.counters() if self._folder is not None else None

    @property
    def emulator(self) -> Any:
        if self._emulator is None:
            from neuron_app.backends.emulator.rules import NeuronEmulator

            if self._folder is None:
                raise RuntimeError("prepare_cache must run before the emulator starts")
            emulator = NeuronEmulator(self._folder, self.rules)
            # One process, one device: every manager here shares its core's HBM, as two pipelines on one
            # NeuronCore do (the fourth review's T2: a second klein-4B on the selftest's core).
            emulator.memory = _core_memory(emulator.hbm_bytes)
            self._emulator = emulator
        return self._emulator

    # --- the device ------------------------------------------------------------------------------
    def adopt(self, pipe: Any, host_modules: tuple[Any, ...] = (), placement: Any = None) -> None:
        """`pipe.to("neuron")`, or each component to its own `neuron:N` (`placement`): weights on their core,
        compiled callables as device graphs."""
        super().adopt(pipe, host_modules)
        from neuron_app.backends.emulator.numbering import STATE

        em = self.emulator
        apart = placement is not None and placement.name not in (None, "together")
        for name, component in pipe.components.items():
            if hasattr(component, "parameters"):  # together: this process's first core (a rank's own), not the
                # current device, which any earlier allocation of this thread may have moved (`current-device`)
                self.adopt_module(component, placement.index_of(name) if apart else STATE.start)
        for module in host_modules:
            em.place(list(module.parameters()) + list(module.buffers()), False)
        decoder = getattr(getattr(pipe.vae, "decode", None), "__self__", None)
        if getattr(decoder, "compiled", False):
            decoder._tile_fn = self.wrap_graph(decoder._tile_fn, "vae_tile")

    def adopt_module(self, module: Any, index: int | None = None) -> None:
        """`module.to("neuron:N")`: its weights on that core (moved there from another; None: the current device,
        a torchrun rank's own), its compiled callables (`module.compile`) device graphs."""
        self.emulator.adopt(module, index)
        self._wrap_compiled(module)

    def _wrap_compiled(self, module: Any) -> None:
        for sub in module.modules():
            impl = getattr(sub, "_compiled_call_impl", None)
            if impl is not None:
                sub._compiled_call_impl = self.wrap_graph(impl, type(sub).__name__)

    def tp_mesh(self, world_size: int) -> Any:
        """The guide's `DeviceMesh("neuron", ...)` over gloo, with the emulated device as torch's accelerator, so
        that diffusers' TensorParallelConfig really shards (as under `python -m neuron_app emulate`)."""
        from neuron_app.backends.emulator import device as emulator_device
        from neuron_app.backends.emulator.numbering import on_process_group

        emulator_device.register_accelerator()
        emulator_device.register_dist_backend()
        on_process_group()  # the group is gloo here: TorchNeuron's numbering as its own group sets it (neuron:<rank>)
        return super().tp_mesh(world_size)

    @contextlib.contextmanager
    def sharded_load(self, mesh: Any) -> Iterator[None]:
        """diffusers places each shard on the current device (the accelerator, which says available for this
        load): the emulator makes those CPU tensors on the device. Inside a device graph the mesh says `cpu`, as
        under `python -m neuron_app emulate` (`emulator/numbering.py:meshes_on_host`, every script gets it)."""
        from neuron_app.backends.emulator.device import _DeviceModule

        _DeviceModule.available = True
        try:
            with self.emulator.device_work():
                yield
        finally:
            _DeviceModule.available = False

    def wrap_graph(self, fn: Any, name: str) -> Any:
        return fn if hasattr(fn, "neuron_graph") else self.emulator.graph(fn, name)

    def device_work(self) -> contextlib.AbstractContextManager[None]:
        return self.emulator.device_work()

    def _device_check(self, gm: Any, example_inputs: Any) -> None:
        """The emulator's rules and artifact, inside NeuronBackend's meter (its NKI gate, its graph misses)."""
        self.emulator.check_graph(gm, example_inputs)

    def fallback_ops(self) -> list[str]:
        return self.emulator.fallback_invocations() if self._emulator is not None else []

    def nki_kernel_failures(self) -> int | None:
        """No NKI kernel runs here: whether attention takes it is the gate's prediction (T10)."""
        return None

    def rules_status(self) -> dict[str, Any] | None:
        if self._emulator is None:
            status = {"mode": self.rules, "violations": [], "violation_count": 0, "eager_signatures": 0}
        else:
            status = self.emulator.snapshot()
        nki = "predicted: TorchNeuron's gate on the traced graph; no kernel runs here (the selftest measures it)"
        return status | {"cores": list(self.cores), "nki_attention": nki}

    def fingerprint_fields(self) -> dict[str, Any]:
        fields = super().fingerprint_fields()
        fields["emulator"] = "neuron-emulated: CPU tensors under TorchNeuron's rules, no NEFFs"
        return fields
