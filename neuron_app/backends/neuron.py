"""AWS Trainium (Trn2, Trn3) through TorchNeuron: the "neuron" device and compile backend.

Which torch-neuronx is installed (TorchNeuron or the PyTorch/XLA package) is checked first, torch-free
(`neuron_sdk.py`), and the `neuron` device second. The SDK is imported only when this backend is chosen;
`neuron_app.environment` has exported its cache folder and fallback switches before torch loads.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuron_app.backends.base import CacheProbe, CacheVerdict, DeviceBackend, FolderCacheProbe
from neuron_app.backends.neuron_sdk import INSTALL_HINT, SDK_DIST, SDK_MODULE, check_sdk, installed_version
from neuron_app.environment import NEFF_KEY_VARS, dist_version
from neuron_app.errors import DeviceUnavailable

log = logging.getLogger(__name__)

#: Variables that change a NEFF without changing the HLO (TorchNeuron's disk key may not cover them).
FINGERPRINT_VARS = NEFF_KEY_VARS


def neuron_device_count() -> int:
    """NeuronCores torch sees through TorchNeuron's `neuron` device module (0 when torch has none: the XLA
    package never registers it)."""
    import torch

    module = getattr(torch, "neuron", None)
    if module is None or not module.is_available():
        return 0
    return int(module.device_count())


Counters = tuple[int, int]  # (persistent hits, persistent misses)


def sdk_cache_counters() -> Counters | None:
    """TorchNeuron's persistent-cache counters (`_C._get_compilation_cache_stats()`, private, so guarded).

    Its cache looks in memory first and counts a persistent hit or miss only after an in-memory miss
    (TorchNeuron's CompilationCache.cpp, as the second review read it): a graph this process already has moves
    neither counter.
    """
    try:
        import torch_neuronx

        c = torch_neuronx._C
        if hasattr(c, "_neuron_set_metrics_enabled"):
            c._neuron_set_metrics_enabled(True)
        stats = c._get_compilation_cache_stats()
        return int(stats["persistent_hits"]), int(stats["persistent_misses"])
    except Exception:
        return None


class NeuronCacheProbe(CacheProbe):
    """TorchNeuron's own persistent-cache counters; the NEFF folder when they cannot be read.

    The counters count only this process's compiles, where new files in a shared folder can come
    from another process compiling at the same time. Neither counter moving means this process served
    the graphs from its in-memory cache: `memory`, not a miss (a second manager in one process).
    """

    def __init__(self, folder: Path, counters: Callable[[], Counters | None] = sdk_cache_counters) -> None:
        self.folder_probe = FolderCacheProbe(folder)
        self._read = counters

    @staticmethod
    def _counters() -> Counters | None:
        return sdk_cache_counters()

    def snapshot(self) -> tuple[str, Any]:
        counters = self._read()
        if counters is not None:
            return ("counters", counters)
        return ("folder", self.folder_probe.snapshot())

    def judge(self, before: tuple[str, Any], after: tuple[str, Any]) -> CacheVerdict:
        if before[0] == after[0] == "counters":
            hits, misses = (a - b for a, b in zip(after[1], before[1], strict=True))
            if misses > 0:
                return "miss"
            return "disk" if hits > 0 else "memory"
        if before[0] == after[0] == "folder":
            return self.folder_probe.judge(before[1], after[1])
        return "miss"


class NeuronBackend(DeviceBackend):
    name = "neuron"
    default_dtype = "bfloat16"
    default_compile_backend = "neuron"
    #: T8: one neuronx-cc job for the whole 4B transformer (5 + 20 blocks, up to 5120 joint tokens) has never been
    #: measured to compile, and AWS's klein-9B port split projections to stay under the compiler's limits: one
    #: graph per block class until a trn2 measures `full` (compile time, host RAM, seconds per image).
    default_compile_mode = "regional"
    dist_backend = "neuron"
    compiles_eager_ops_per_shape = True  # every op compiles to a NEFF on first use at each shape
    tiles_vae_by_default = True  # a whole-image FLUX.2 decode is past neuronx-cc's instruction limit

    def __init__(self) -> None:
        self._graph_lock = threading.Lock()
        #: Persistent-cache misses met while a graph compiled or first ran: not eager ops (N7).
        self.graph_misses = 0
        #: Per transformer graph compiled, in order: does its attention take the NKI kernel (None: no SDPA).
        self._attention: list[bool | None] = []

    def is_available(self) -> bool:
        """Some torch-neuronx is installed; `require` tells TorchNeuron from the XLA package (so `auto`
        never falls back to the CPU silently on a machine with the wrong stack)."""
        return installed_version() is not None or importlib.util.find_spec(SDK_MODULE) is not None

    def require(self) -> None:
        self.require_sdk()
        self.check_device()

    def require_sdk(self) -> None:
        """The package checks, no device touched (under torchrun this runs before init_process_group)."""
        check_sdk()
        try:
            importlib.import_module(SDK_MODULE)
        except Exception as exc:  # a broken SDK install: say so in one line
            raise DeviceUnavailable(f"{SDK_MODULE} failed to import ({exc}): {INSTALL_HINT}") from exc
        from neuron_app.backends.nki_gate import watch_kernel_failures

        self._kernel_failures = watch_kernel_failures()

    def nki_kernel_failures(self) -> int | None:
        """NKI attention kernel calls that failed while graphs compiled in this process, after which TorchNeuron
        decomposed attention silently (T10: measured on the device); None where no TorchNeuron compiles."""
        watch = getattr(self, "_kernel_failures", None)
        return None if watch is None else watch.count

    def check_device(self) -> None:
        """torch has the `neuron` device with at least one NeuronCore; under torchrun call it only after
        init_process_group (TorchNeuron asserts the runtime is not started before)."""
        try:
            count = neuron_device_count()
        except Exception as exc:
            raise DeviceUnavailable(
                f"the neuron device could not be queried ({exc}); run python -m neuron_app doctor"
            ) from exc
        if count < 1:
            cores = os.environ.get("NEURON_RT_VISIBLE_CORES")
            raise DeviceUnavailable(
                "torch has no usable 'neuron' device"
                + (f" (NEURON_RT_VISIBLE_CORES={cores})" if cores else "")
                + ": is this a Trn2/Trn3 instance with the Neuron driver, and are the cores free of other "
                "processes? run python -m neuron_app doctor"
            )

    def core_ids(self) -> list[int] | None:
        """The runtime's NeuronCores behind `neuron:0`, `neuron:1`, ...: NEURON_RT_VISIBLE_CORES' range, else the
        first `device_count()` (TorchNeuron counts the visible logical cores)."""
        from neuron_app.environment import VISIBLE_CORES_VAR, parse_cores

        visible = os.environ.get(VISIBLE_CORES_VAR, "").strip()
        if visible:
            first, last = parse_cores(visible)
            return list(range(first, last + 1))
        return list(range(neuron_device_count()))

    def torch_device_at(self, index: int) -> str:
        return f"neuron:{index}"

    def plan_family(self) -> str:
        try:  # the EC2 instance type, as doctor reads it (no network call)
            found = Path("/sys/devices/virtual/dmi/id/product_name").read_text(errors="replace")
        except OSError:
            found = ""
        family = found.strip().split(".")[0].lower()
        return family[:4] if family.startswith(("trn2", "trn3")) else "trn2"

    def prepare_cache(self, cache_dir: Path) -> None:
        super().prepare_cache(cache_dir)
        from neuron_app.environment import NEFF_CACHE_VAR, neff_cache_dir, set_unless_user

        folder = neff_cache_dir(cache_dir)  # `neff/<SDK release and flags>` (T12), or the user's own folder
        if set_unless_user(NEFF_CACHE_VAR, str(folder)).origin == "app":
            folder.mkdir(parents=True, exist_ok=True)

    def compiled_artifacts_dirs(self, cache_dir: Path) -> list[Path]:
        """The NEFF folder (the whole `neff/`, every SDK's subfolder: a pull installs each where its SDK looks)."""
        from neuron_app.environment import NEFF_CACHE_VAR, neff_cache_dir, origin

        neffs = neff_cache_dir(cache_dir) if origin(NEFF_CACHE_VAR) == "user" else cache_dir / "neff"
        return [neffs, cache_dir / "inductor"]

    def cache_probe(self, compile_backend: str, cache_dir: Path) -> CacheProbe:
        # Eager mode compiles ops into NEFFs too, so the evidence holds in every mode.
        from neuron_app.environment import neff_cache_dir

        return NeuronCacheProbe(neff_cache_dir(cache_dir), counters=self.settled_counters)

    def synchronize(self) -> None:
        """Wait for every core this process holds: NEFF compilation and execution are asynchronous, so an error
        surfaces here. TorchNeuron's `synchronize()` without an index waits for the current device only
        (`NeuronStream.cpp`, the seventh review's V5), and with components apart core 1 has its own queue."""
        import torch

        for index in range(max(torch.neuron.device_count(), 1)):
            torch.neuron.synchronize(index)

    def current_device_index(self) -> int | None:
        import torch

        return int(torch.neuron.current_device())

    def set_current_device(self, index: int) -> None:
        """TorchNeuron runs a compiled graph on the current device (its executor reads `current_device()`)."""
        import torch

        torch.neuron.set_device(index)

    def tp_mesh(self, world_size: int) -> Any:
        """One NeuronCore per rank (the guide's `DeviceMesh("neuron", ...)`)."""
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh("neuron", list(range(world_size)))

    def fingerprint_fields(self) -> dict[str, Any]:
        """What changes a NEFF besides the model and shapes: SDK versions, compiler flags, logical-core setting,
        how SDPA is lowered (NKI kernel or decomposed) and the chip the NEFFs are for (trn2 vs trn3)."""
        fields: dict[str, Any] = {dist: dist_version(dist) or "absent" for dist in (SDK_DIST, "neuronx-cc", "nki")}
        for var in FINGERPRINT_VARS:
            fields[var] = os.environ.get(var, "")
        fields["platform_target"] = self._platform_target()
        return fields

    @staticmethod
    def _platform_target() -> str:
        """`torch_neuronx._C._get_platform_target()` (private, so guarded): a shared cache never serves trn2
        NEFFs to a trn3."""
        if importlib.util.find_spec(SDK_MODULE) is None:
            return "none"
        try:
            import torch_neuronx

            return str(torch_neuronx._C._get_platform_target())
        except Exception:
            return "unknown"

    def cache_counters(self) -> Counters | None:
        """The persistent-cache counters this backend reads (TorchNeuron's; the emulator's on neuron-emulated)."""
        return sdk_cache_counters()

    def check_graph(self, gm: Any, example_inputs: Any, component: str = "transformer") -> Callable[[Any], Any]:
        """Judge the graph's attention by TorchNeuron's NKI gate, and meter the cache misses its compile and
        first run cause, so that eager compiles are counted from the other misses only."""
        from neuron_app.backends.nki_gate import attentions, summary

        before = self.settled_counters()  # the text encoder's queued eager misses land before, not inside
        self._device_check(gm, example_inputs)
        if component == "transformer":
            verdict = summary(attentions(gm))
            with self._graph_lock:
                self._attention.append(verdict)
        return self._meter(before)

    def _device_check(self, gm: Any, example_inputs: Any) -> None:
        """What the device itself checks of a graph before it compiles (the emulator's rules); nothing here."""

    def settled_counters(self) -> Counters | None:
        """The counters once the device has done what was queued (T3): TorchNeuron compiles and runs on its own
        stream, and its counters move when its worker looks a key up, not when the Python call returns."""
        self.synchronize()
        return self.cache_counters()

    def _meter(self, before: Counters | None) -> Callable[[Any], Any]:
        def add(start: Counters | None) -> None:
            now = self.settled_counters()
            if start is not None and now is not None:
                with self._graph_lock:
                    self.graph_misses += max(0, now[1] - start[1])

        def finish(compiled: Any) -> Any:
            add(before)  # a compiler that builds its NEFF when called
            pending = [True]

            def first_run_metered(*args: Any, **kwargs: Any) -> Any:
                if not pending:
                    return compiled(*args, **kwargs)
                pending.clear()
                start = self.settled_counters()  # once per new graph: what was queued before it is not its own
                out = compiled(*args, **kwargs)
                add(start)  # one that builds it on the first run (read after the device is done)
                return out

            return first_run_metered

        return finish

    def attention_mark(self) -> int:
        with self._graph_lock:
            return len(self._attention)

    def nki_attention_since(self, mark: int) -> bool | None:
        """Whether every transformer graph compiled since `mark` takes the NKI kernel (None: none had attention)."""
        with self._graph_lock:
            found = [v for v in self._attention[mark:] if v is not None]
        return None if not found else all(found)

    def eager_compile_count(self, graphs_total: int) -> int:
        """Persistent misses of this process that no graph caused: eager ops compiled to NEFFs (N7). A graph
        loaded from disk is a hit and subtracts nothing; one served from memory moves no counter."""
        counters = self.cache_counters()
        with self._graph_lock:
            return 0 if counters is None else max(0, counters[1] - self.graph_misses)

    def fallback_ops(self) -> list[str]:
        """What ran on the CPU: `torch_neuronx.get_fallback_ops()` (unimplemented ops still fall back with the
        fail-fast switches set)."""
        try:
            import torch_neuronx

            return [str(op) for op in torch_neuronx.get_fallback_ops()]
        except Exception:
            return []

    def fallback_state(self) -> str:
        from neuron_app.environment import fallback_state

        return fallback_state(self.fallback_ops())
