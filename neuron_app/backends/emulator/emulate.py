"""`python -m neuron_app emulate SCRIPT [ARGS]` / `emulate -m MODULE [ARGS]`: anyone's script on the emulator.

Like `python -m coverage run`: the emulated neuron device is installed, then the script runs as `__main__`
with its own arguments, and a summary is printed at exit (eager compiles, graphs, violations, fallbacks and
NKI attention per graph). What is installed, so that the diffusers guide's code runs unchanged:

- the `neuron` device (torch's PrivateUse1 slot) and `torch.neuron` with `is_available()` True,
  `device_count()`, `current_device()`, `synchronize()` (where latched errors surface);
- `module.to("neuron")` / `pipe.to("neuron")`, which really adopt the weights (the rules then apply);
- the `neuron` torch.compile backend (the rules and the NKI gate on each graph, `aot_eager` standing in for
  neuronx-cc), for `module.compile(backend="neuron")`, `compile_repeated_blocks` and `torch.compile(fn, ...)`;
- the `neuron` torch.distributed backend over gloo, so `init_process_group(backend="neuron")` and
  `DeviceMesh("neuron", ...)` work under torchrun, and the emulated device as torch's accelerator, so diffusers'
  TensorParallelConfig shards the transformer (DTensor slices on each rank's device; the summary names them);
- TORCH_NEURONX_NEFF_CACHE_DIR (its `emulated/` subfolder holds the artifacts, apart from real NEFFs) and
  TORCH_NEURONX_ENABLE_NKI_SDPA=0 (attention then never takes the kernel), read as TorchNeuron reads them (the
  latter at each compiled graph, so a fixture that sets it after start is obeyed);
- TorchNeuron's fork rule (a child forked after the device was used is refused at its first device use;
  `lifecycle.py`), `spawn` children that start the emulator themselves, and `dynamic` read as TorchNeuron reads it
  (the default recompiles per shape, `dynamic=True` is refused); the stand-in compiler's failures named as its own
  (`standin.py`).
- an emulated `torch_neuronx` (`emulator/sdk.py`, version `...+emulated`), so code that looks for the SDK
  before it uses the device (diffusers' `is_torch_neuronx_available`, its `require_torch_neuron` tests) runs.
Every thread the script starts runs under the rules too (a thread pool loading weights, a threaded server).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from neuron_app.errors import DeviceUnavailable

#: TorchNeuron's default NEFF cache folder (the guide); the emulator's artifacts go into its `emulated/`.
DEFAULT_NEFF_CACHE = "/tmp/neff_cache"


def take_cores() -> list[int]:
    """The NeuronCores this process asks the runtime for (`NEURON_RT_VISIBLE_CORES`, a torchrun rank's
    `LOCAL_RANK`, `NEURON_RT_NUM_CORES`, else every core), held until it exits, said in one line on stderr;
    `neuron:N` is the N-th of them (`numbering.py`). Held by another process: the runtime's refusal."""
    from neuron_app.backends.emulator import cores

    inst = cores.instance()
    try:
        held = cores.acquire()
    except DeviceUnavailable as exc:
        asked = cores.requested()[1]
        raise DeviceUnavailable(
            f"Logical Neuron Core(s) not available - Requested:{asked} Available:{cores.free_count()} "
            f"(the Neuron runtime's refusal; neuron-emulated: {exc})"
        ) from exc
    span = f"{held[0]}-{held[-1]}" if len(held) > 1 else str(held[0])
    rank = os.environ.get("LOCAL_RANK")
    devices = (
        f"neuron:{rank} after init_process_group(backend='neuron'), as TorchNeuron numbers a rank's core"
        if rank is not None and len(held) == 1
        else f"torch.neuron.device_count() {len(held)}, neuron:0 is core {held[0]}"
    )
    print(
        f"neuron-emulated: this process holds NeuronCore(s) {span} of the emulated {inst.name} (pid {os.getpid()}): "
        f"{devices}",
        file=sys.stderr,
        flush=True,
    )
    return held


def install(mode: str = "enforce") -> Any:
    """Install the emulated device, its compile and distributed backends; returns the emulator."""
    import torch

    from neuron_app.backends.emulator import device as emulator_device
    from neuron_app.backends.emulator import lifecycle
    from neuron_app.backends.emulator import numbering as memory_api
    from neuron_app.backends.emulator.rules import NeuronEmulator

    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # A torchrun rank: the runtime starts at init_process_group (its core: NEURON_RT_VISIBLE_CORES, else
        # LOCAL_RANK) or at a device use before it (then every core it sees, and init_process_group refuses).
        lifecycle.defer(take_cores)
    else:
        take_cores()
    folder = Path(os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR") or DEFAULT_NEFF_CACHE) / "emulated"
    em = NeuronEmulator(folder, mode)
    emulator_device._DeviceModule.available = True
    emulator_device._DeviceModule.memory = em.memory
    memory_api.install(emulator_device._DEVICE_MODULE)
    emulator_device._DeviceModule.synchronize_hook = lambda: (em.store.flush(), em.synchronize())  # counters land
    emulator_device.register_accelerator()
    sys.modules.setdefault("torch.neuron", emulator_device._DEVICE_MODULE)  # torch imports it as a module too

    def neuron_compiler(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._dynamo import lookup_backend

        from neuron_app.backends.emulator.standin import stand_in

        em.check_graph(gm, example_inputs)  # the rules, and the NKI gate with TORCH_NEURONX_ENABLE_NKI_SDPA as now
        return lookup_backend(stand_in())(gm, example_inputs, **kwargs)

    if "neuron" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(compiler_fn=neuron_compiler, name="neuron")
    emulator_device.register_dist_backend()
    _patch_module_to(em)
    _patch_compile(em)
    _patch_threads(em)
    _patch_spawn(mode)
    if os.environ.get("NEURON_EMULATOR_SDK", "1") != "0":
        from neuron_app.backends.emulator import sdk

        sdk.install(em)
    return em


def _patch_threads(em: Any) -> None:
    """Every thread started from now on runs under the rules, as every thread of a process sees the device
    (TorchNeuron's device is process-wide; the emulator's modes are per thread, so each thread enters them)."""
    import threading

    start = threading.Thread.start

    def start_under_rules(self: threading.Thread) -> None:
        run = self.run

        def run_under_rules() -> None:
            with em.device_work():
                run()

        self.run = run_under_rules  # type: ignore[method-assign]
        start(self)

    threading.Thread.start = start_under_rules  # type: ignore[method-assign]


def _patch_spawn(mode: str) -> None:
    """A `spawn` multiprocessing child starts the emulator before it unpickles its target, as a spawned child on a
    device starts a runtime of its own (a forked one may not: `lifecycle.py`; `forkserver` is not covered)."""
    from multiprocessing import spawn

    original = spawn.get_command_line
    if getattr(original, "neuron_emulated", False):
        return
    root = str(Path(__file__).resolve().parents[3])

    def get_command_line(**kwds: Any) -> list[str]:
        line = original(**kwds)
        at = line.index("-c") + 1
        line[at] = (
            f"import sys; sys.path.insert(0, {root!r}); import {__name__} as e; e.spawn_child({mode!r}); {line[at]}"
        )
        return line

    get_command_line.neuron_emulated = True  # type: ignore[attr-defined]
    spawn.get_command_line = get_command_line  # type: ignore[assignment]


_CHILD_WORK: list[Any] = []


def spawn_child(mode: str) -> None:
    """In a spawned child of `emulate`: the emulated device installed and its rules on for the child's main thread,
    before multiprocessing runs the target (no summary: the parent prints its own)."""
    work = install(mode).device_work()
    work.__enter__()  # for the rest of the process, as `main` does for the script
    _CHILD_WORK.append(work)  # held: a collected context manager would leave the rules


def _patch_module_to(em: Any) -> None:
    import torch

    from neuron_app.backends.emulator import lifecycle
    from neuron_app.backends.emulator.device import _is_device_arg, _is_neuron
    from neuron_app.backends.emulator.numbering import STATE

    original = torch.nn.Module.to

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device", next((a for a in args if _is_device_arg(a)), None))
        if not _is_neuron(device):
            return original(self, *args, **kwargs)
        rest = [a for a in args if not _is_device_arg(a)]
        options = {k: v for k, v in kwargs.items() if k != "device"}
        lifecycle.use()
        index = STATE.resolve(device)  # `neuron:N` past the process's cores fails as on TorchNeuron
        elsewhere = {em.index_of(t) for t in [*self.parameters(), *self.buffers()]} - {None, index}
        if elsewhere:  # each weight's `.to` is a copy between two cores (`cross-core-copy`)
            em.refuse_cross_core(min(elsewhere), index, f"{type(self).__name__}.to")
        if rest or options:  # a dtype too: convert on the host, then adopt
            original(self, *rest, **options)
        em.adopt(self, index)
        return self

    torch.nn.Module.to = to  # type: ignore[method-assign]


def _device_graph(em: Any, fn: Any, name: str) -> Any:
    """`em.graph`, with `torch.neuron` saying "no device" while dynamo traces and runs it: torch's accelerator
    machinery (streams) would otherwise ask the C++ side, which has no neuron device."""
    from neuron_app.backends.emulator.device import _DeviceModule

    graph = em.graph(fn, name)

    def run(*args: Any, **kwargs: Any) -> Any:
        _DeviceModule.available = False
        try:
            return graph(*args, **kwargs)
        finally:
            _DeviceModule.available = True

    run.neuron_graph = name  # type: ignore[attr-defined]
    return run


def static_by_default(kwargs: dict[str, Any]) -> dict[str, Any]:
    """TorchNeuron's reading of `dynamic` (AWS reference-torch-compile: "dynamic=True is rejected during compilation.
    Shapes that vary between steps run, recompiling per new shape"): for the neuron backend the default `dynamic`
    compiles each new shape statically, where torch would trace a symbolic graph at the second shape;
    `dynamic=True` is passed on and the graph's rule refuses it."""
    if kwargs.get("backend") == "neuron" and kwargs.get("dynamic") is None:
        return kwargs | {"dynamic": False}
    return kwargs


def _patch_compile(em: Any) -> None:
    import torch

    module_compile = torch.nn.Module.compile
    torch_compile = torch.compile

    def compile_module(self: Any, *args: Any, **kwargs: Any) -> None:
        module_compile(self, *args, **static_by_default(kwargs))
        if kwargs.get("backend") == "neuron" and self._compiled_call_impl is not None:
            self._compiled_call_impl = _device_graph(em, self._compiled_call_impl, type(self).__name__)

    def compile_fn(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # `@torch.compile(backend="neuron")`: the decorator compiles what it is given
            return lambda fn: compile_fn(fn, **kwargs)
        out = torch_compile(model, **static_by_default(kwargs))
        if kwargs.get("backend") != "neuron" or not callable(out):
            return out
        if isinstance(out, torch.nn.Module):  # torch.compile(module): its OptimizedModule's forward is the graph
            forward = getattr(out, "forward", None)
            if callable(forward) and not hasattr(forward, "neuron_graph"):
                out.forward = _device_graph(em, forward, type(model).__name__)
            return out
        return _device_graph(em, out, getattr(model, "__name__", "graph"))

    torch.nn.Module.compile = compile_module  # type: ignore[method-assign]
    torch.compile = compile_fn  # type: ignore[assignment]


def _live_shards() -> dict[str, Any] | None:
    """The DTensor parameters alive in this process (the script's own model, sharded by diffusers' tensor
    parallelism without ever being adopted by `.to("neuron")`)."""
    import gc

    from neuron_app.backends.emulator.device import shard_report

    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor

    # By type, not isinstance: a metaclass check would read attributes of every object (deprecation warnings).
    return shard_report(o for o in gc.get_objects() if issubclass(type(o), DTensor) and getattr(o, "_is_param", False))


def summary(em: Any) -> str:
    """What the script did on the emulated device, in a few lines."""
    em.store.flush()  # the compile queue's counts land first (emulator/cache.py), as a synchronize would
    snap = em.snapshot()
    fallbacks = ", ".join(f"{op} x{n}" for op, n in sorted(snap["fallback_ops"].items())) or "none"
    world = os.environ.get("WORLD_SIZE")
    lines = [
        "neuron-emulated summary" + (f" (rank {os.environ.get('RANK', '0')} of {world})" if world else ""),
        f"  eager compiles {snap['eager_compiles']} (signatures in the cache {snap['eager_signatures']}); "
        f"graphs compiled {snap['graph_compiles']}; cache {snap['cache']}",
        f"  violations {snap['violation_count']}" + (f": last {snap['violations'][-1]}" if snap["violations"] else ""),
        f"  fallbacks to the CPU: {fallbacks} (host round trips {snap['host_round_trips']})",
        f"  device memory {snap['hbm_in_use_gib']} GiB in use (weights {snap['weight_gib']} GiB), peak "
        f"{snap['hbm_peak_gib']} GiB, of {snap['hbm_gib']} GiB HBM per bank; int64 ops {snap['int64_ops']}",
    ]
    if len(snap["devices"]) > 1:
        lines.append(
            "  per device: "
            + "; ".join(
                f"neuron:{d['index']} (core {d['core']}) {d['in_use_gib']} GiB, peak {d['peak_gib']}"
                for d in snap["devices"]
            )
        )
    shards = snap["tensor_parallel"] or _live_shards()
    if shards:
        lines.append(
            f"  tensor parallel: mesh {shards['mesh']}, {shards['sharded']} sharded parameters (this rank holds "
            f"{shards['local_elements']} of their {shards['elements']} elements, {shards['share']:.2f}), "
            f"{shards['replicated']} replicated"
        )
    for entry in snap["graph_attention"]:
        if entry["sdpa"]:
            verdict = "yes" if entry["nki"] else f"no ({entry['why_not']})"
            lines.append(f"  graph {entry['graph']}: {entry['sdpa']} attention call(s), NKI attention {verdict}")
    return "\n".join(lines)


def write_whole(text: str) -> None:
    """The block and its newline in one write(2) to stderr: torchrun's ranks share one pipe, and `print` writes its
    newline apart, so another rank's summary began on this one's last line (CI, stop 60). A pipe keeps one write of
    up to 4 KiB whole; a summary is well under that."""
    sys.stderr.flush()
    data = (text + "\n").encode()
    while data:
        data = data[os.write(2, data) :]


USAGE = """usage: python -m neuron_app emulate [--rules enforce|record] (SCRIPT | -m MODULE) [ARGS ...]

Run a script, or a module as __main__ (like python -m), on the emulated neuron device; everything after SCRIPT
or MODULE is its own arguments. A summary is printed to stderr at exit."""


def parse(argv: list[str]) -> tuple[str, str | None, str | None, list[str]]:
    """(rules, module, script, the target's own arguments); the target's options are never ours."""
    rules, rest = "enforce", list(argv)
    while rest and rest[0] in ("--rules", "-h", "--help"):
        if rest[0] != "--rules":
            print(USAGE)
            raise SystemExit(0)
        if len(rest) < 2 or rest[1] not in ("enforce", "record"):
            raise SystemExit("error: --rules takes enforce or record")
        rules, rest = rest[1], rest[2:]
    if rest[:1] == ["-m"]:
        if len(rest) < 2:
            raise SystemExit("error: -m needs a MODULE")
        return rules, rest[1], None, rest[2:]
    if not rest:
        raise SystemExit(f"error: name a SCRIPT, or -m MODULE\n{USAGE}")
    return rules, None, rest[0], rest[1:]


def main(argv: list[str]) -> int:
    rules, module, script, rest = parse(argv)
    try:
        em = install(rules)
    except DeviceUnavailable as exc:  # the cores are another process's: one line, as the runtime's start fails
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    kept: list[Any] = []  # the script's globals: held by `report` until the summary has read its model

    def report() -> None:
        write_whole(summary(em))
        kept.clear()

    atexit.register(report)
    with em.device_work():
        if module is not None:
            sys.argv = [module, *rest]
            kept.append(runpy.run_module(module, run_name="__main__", alter_sys=True))
        else:
            assert script is not None
            sys.argv = [script, *rest]
            sys.path.insert(0, str(Path(script).resolve().parent))
            kept.append(runpy.run_path(script, run_name="__main__"))
    return 0
