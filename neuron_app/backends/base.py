"""What every device backend provides, and how a compile's cache result is judged."""

from __future__ import annotations

import contextlib
import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Literal

from neuron_app.errors import DeviceUnavailable

log = logging.getLogger(__name__)

CacheVerdict = Literal["disk", "miss", "memory"]


class CacheProbe:
    """Evidence of a persistent-cache hit, read before and after a compile.

    The base probe knows no disk cache (aot_eager, eager): every compile is a miss.
    """

    def snapshot(self) -> Any:
        return None

    def judge(self, before: Any, after: Any) -> CacheVerdict:
        return "miss"


class InductorCacheProbe(CacheProbe):
    """Inductor's own counters: FX-graph and AOT-autograd cache hits vs misses."""

    def snapshot(self) -> tuple[int, int, int, int]:
        from torch._dynamo.utils import counters

        return (
            counters["inductor"]["fxgraph_cache_hit"],
            counters["inductor"]["fxgraph_cache_miss"],
            counters["aot_autograd"]["autograd_cache_hit"],
            counters["aot_autograd"]["autograd_cache_miss"],
        )

    def judge(self, before: tuple[int, ...], after: tuple[int, ...]) -> CacheVerdict:
        fx_hit, fx_miss, ag_hit, ag_miss = (a - b for a, b in zip(after, before, strict=True))
        hits, misses = fx_hit + ag_hit, fx_miss + ag_miss
        return "disk" if hits > 0 and misses == 0 else "miss"


class FolderCacheProbe(CacheProbe):
    """A compiler that writes one artifact per graph (Neuron's NEFF files): no new file means a hit."""

    def __init__(self, folder: Path, pattern: str = "*.neff") -> None:
        self.folder, self.pattern = folder, pattern

    def snapshot(self) -> frozenset[str]:
        if not self.folder.is_dir():
            return frozenset()
        return frozenset(str(p.relative_to(self.folder)) for p in self.folder.rglob(self.pattern))

    def judge(self, before: frozenset[str], after: frozenset[str]) -> CacheVerdict:
        return "disk" if after and not (after - before) else "miss"


class DeviceBackend(ABC):
    name: ClassVar[str]
    default_dtype: ClassVar[str]
    default_compile_backend: ClassVar[str] = "inductor"
    #: What `compile_mode = "auto"` means on this device.
    default_compile_mode: ClassVar[str] = "full"
    #: torch.distributed backend for tensor-parallel ranks.
    dist_backend: ClassVar[str]
    #: True where eager ops (the VAE decoder, the text encoder) are compiled per input shape too, so a
    #: transposed shape is not ready just because its transformer graph is.
    compiles_eager_ops_per_shape: ClassVar[bool] = False
    #: Whether `vae_compile = "auto"` decodes in compiled tiles here (one VAE graph for every shape).
    tiles_vae_by_default: ClassVar[bool] = False

    @abstractmethod
    def is_available(self) -> bool: ...

    def require(self) -> None:
        """Raise `DeviceUnavailable` with a fix when the device cannot be used."""
        if not self.is_available():
            raise DeviceUnavailable(f"device {self.name!r} is not available on this machine")

    def require_sdk(self) -> None:
        """The checks that touch no device (under torchrun they run before init_process_group)."""
        self.require()

    def check_device(self) -> None:  # noqa: B027 (optional hook: most devices have nothing more to check)
        """The device checks; under torchrun they run after init_process_group."""

    def synchronize(self) -> None:  # noqa: B027 (optional hook: synchronous devices have nothing to wait for)
        """Wait for queued device work on every core this process holds, so an asynchronous failure surfaces in the
        call that caused it."""

    def current_device_index(self) -> int | None:
        """The thread's current device index (where a compiled graph runs on Neuron); None without indices."""
        return None

    def set_current_device(self, index: int) -> None:  # noqa: B027 (optional hook: no indices, nothing to set)
        """Make device `index` current for this thread (`placement.place_pipeline`: each stage on its own core)."""

    def drain(self) -> None:
        """After a failed device call: wait for the device and drop what it latched (logged), so that the next,
        unrelated call does not inherit the error (TorchNeuron can latch one into the next device op)."""
        try:
            self.synchronize()
        except Exception as exc:
            from neuron_app.errors import one_line

            log.warning("device error latched by a failed call, dropped: %s", one_line(exc))

    def configure(self, settings: Any) -> None:  # noqa: B027 (optional hook)
        """Take the settings that concern this backend (the emulator's rule mode)."""

    def adopt(self, pipe: Any, host_modules: tuple[Any, ...] = (), placement: Any = None) -> None:
        """After loading: the pipeline is on the device (the emulator marks its weights and graphs). A sharded
        transformer's share is logged: what tells each rank's slice from a replicated copy."""
        from neuron_app.backends.emulator.device import shard_report

        report = shard_report(pipe.transformer.parameters())
        if report is not None:
            log.info(
                "transformer sharded: %d sharded parameter(s), %d replicated; this rank holds %.2f of their elements",
                report["sharded"],
                report["replicated"],
                report["share"],
            )

    def adopt_module(self, module: Any) -> None:  # noqa: B027 (optional hook)
        """One more module moved to the device after loading (the safety classifier's graph): the emulator marks it."""

    def wrap_graph(self, fn: Any, name: str) -> Any:
        """A compiled callable as the device runs it (the emulator: one device graph, outside its rules)."""
        return fn

    def device_work(self) -> contextlib.AbstractContextManager[None]:
        """Context for one call's device work (the emulator enforces TorchNeuron's rules inside it)."""
        return contextlib.nullcontext()

    def tp_mesh(self, world_size: int) -> Any:
        """The DeviceMesh that tensor parallelism shards the transformer over, after `init_process_group`; None
        where diffusers cannot shard (CPU: it has no accelerator), and every rank then runs the whole pipeline."""
        return None

    def sharded_load(self, mesh: Any) -> contextlib.AbstractContextManager[None]:
        """Context around `from_pretrained(parallel_config=...)`, where each rank's shards are made."""
        return contextlib.nullcontext()

    def check_graph(self, gm: Any, example_inputs: Any, component: str = "transformer") -> Any:
        """Called with every graph before it is compiled (the emulator's static-shape rule, its artifacts, the
        NKI attention gate); may return a function that wraps the compiled graph (Neuron meters its cache)."""
        return None

    def attention_mark(self) -> int:
        """A position in the record of compiled graphs' attention (Neuron's NKI gate)."""
        return 0

    def nki_attention_since(self, mark: int) -> bool | None:
        """Whether the transformer graphs compiled since `mark` take the NKI attention kernel; None off Neuron."""
        return None

    def eager_compile_count(self, graphs_total: int) -> int:
        """Eager device ops compiled so far by this process (Neuron compiles each op signature on first use);
        `graphs_total` is the graphs compiled so far, for backends whose counters mix the two."""
        return 0

    def fallback_ops(self) -> list[str]:
        """Ops that ran on the CPU instead of the device so far, once per invocation (TorchNeuron's
        `get_fallback_ops()`)."""
        return []

    def fallbacks_since(self, before: list[str]) -> list[str]:
        """The ops that ran on the CPU since the `fallback_ops()` reading `before`, each named once."""
        from neuron_app.backends.fallbacks import new_fallbacks

        return new_fallbacks(before, self.fallback_ops())

    def rules_status(self) -> dict[str, Any] | None:
        """The emulator's mode, violations and signature count; None on real devices."""
        return None

    def fingerprint_fields(self) -> dict[str, Any]:
        """Device-specific inputs of compiled graphs, added to the manifest fingerprint."""
        return {}

    def fallback_state(self) -> str:
        """Whether failing device work can silently run elsewhere (shown in status)."""
        return f"none on {self.name}"

    def torch_device(self) -> str:
        return self.name

    def core_ids(self) -> list[int] | None:
        """The cores (GPUs) this process holds, in device-index order, for the `placement` setting; None where the
        device has no indices (CPU: placement does not apply)."""
        return None

    def torch_device_at(self, index: int) -> str:
        """The torch device of index `index` of the cores this process holds (`neuron:1`, `cuda:1`)."""
        return self.torch_device()

    def memory_gib_per_core(self) -> float | None:
        """What one core holds, for `placement = "auto"`; None: the instance's published figure (the plan's)."""
        return None

    def plan_family(self) -> str:
        """The Trainium family the plan measures `auto` against (trn2 where the instance is not one)."""
        return "trn2"

    def prepare_cache(self, cache_dir: Path) -> None:
        """Point the compiler's persistent cache into `cache_dir`; runs before torch is imported."""
        folder = cache_dir / "inductor"
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)

    def compiled_artifacts_dirs(self, cache_dir: Path) -> list[Path]:
        return [cache_dir / "inductor"]

    def cache_probe(self, compile_backend: str, cache_dir: Path) -> CacheProbe:
        return InductorCacheProbe() if compile_backend == "inductor" else CacheProbe()
