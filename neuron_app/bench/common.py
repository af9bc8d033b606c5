"""Small pieces shared by the orchestrator, the sections and the workers: statistics, the line protocol, ports,
CPU meters, settings as environment variables, a worker's manager and its timed generates."""

from __future__ import annotations

import functools
import json
import math
import os
import random
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

#: A worker's final answer is one stdout line with this prefix; anything else on stdout is ignored.
RESULT_TAG = "BENCH_RESULT "

PROMPT = "A lighthouse on a cliff at dawn, volumetric light"
OTHER_PROMPT = "A watercolor fox reading a book under a cherry tree"


def percentile(values: Sequence[float], q: int) -> float:
    """Linear-interpolated percentile (numpy's default, `statistics.quantiles`' inclusive method), without numpy: the
    parent never imports torch."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median and p95 (what the tables show) plus the raw samples (what the JSON keeps)."""
    return {
        "n": len(values),
        "median_s": percentile(values, 50),
        "p95_s": percentile(values, 95),
        "min_s": min(values) if values else math.nan,
        "max_s": max(values) if values else math.nan,
        "samples_s": [round(v, 5) for v in values],
    }


def seconds(call: Callable[[int], Any], runs: Iterable[int]) -> list[float]:
    """The wall seconds of `call(i)` for each `i` of `runs`, one after another."""
    times = []
    for i in runs:
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return times


def emit(tag: str, payload: dict[str, Any]) -> None:
    """One tagged JSON line on stdout: the only channel from a worker to the orchestrator."""
    sys.stdout.write(tag + json.dumps(payload) + "\n")
    sys.stdout.flush()


def parse_tagged(line: str, tag: str) -> dict[str, Any] | None:
    return json.loads(line[len(tag) :]) if line.startswith(tag) else None


#: Ray's default worker ports are 10002-19999; ports from 20000 up to the kernel's ephemeral range are left.
_FIRST_FREE_PORT = 20000


@functools.cache
def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now that nothing else is likely to take before the caller binds it: below the kernel's
    ephemeral range (where every `bind(0)` and outgoing connection lands; Ray's processes take many) and above
    Ray's worker ports. Port 0's answer is kept only where that band is empty."""
    high = _ephemeral_low() - 1
    draw = random.SystemRandom()  # not the global generator, which a test runner may seed alike in every process
    for _ in range(50) if high > _FIRST_FREE_PORT else ():
        port = draw.randint(_FIRST_FREE_PORT, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def cpu_seconds() -> float:
    """CPU time of this process and its finished children: compared with wall time, it shows contention."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def since_process_start() -> float:
    """Seconds since this process was started (interpreter start-up and imports included)."""
    import psutil

    return time.time() - psutil.Process(os.getpid()).create_time()


class BenchError(RuntimeError):
    """A measurement could not be taken; the section records the message and the run goes on."""


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    import psutil

    times = psutil.cpu_times()  # guest time is already inside user time; steal is not this machine's work
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))


class CpuMeter:
    """Wall time, the machine's busy CPU time and this process's own CPU time since the meter was made."""

    def __init__(self) -> None:
        self.start = (time.monotonic(), _busy_cpu_s(), cpu_seconds())

    def elapsed(self) -> tuple[float, float, float]:
        now = (time.monotonic(), _busy_cpu_s(), cpu_seconds())
        wall, busy, own = (b - a for a, b in zip(self.start, now, strict=True))
        return wall, busy, own

    def others_share(self) -> float:
        """How much of the machine other processes used meanwhile: busy time minus our own (waited) time."""
        wall, busy, own = self.elapsed()
        return max(0.0, min(1.0, (busy - own) / (wall * (os.cpu_count() or 1)))) if wall > 0 else 0.0


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None where either is missing (or the denominator is 0)."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def good_result(path: Any, info: Any, shape: str, seed: int) -> bool:
    """A result counts only if it is this request's image: right shape, right seed, a real file."""
    return (
        isinstance(info, dict)
        and info.get("resolution") == shape
        and info.get("seed") == seed
        and bool(path)
        and Path(path).is_file()
    )


def settings_env(overrides: dict[str, Any]) -> dict[str, str]:
    """Settings overrides as `NEURON_APP_*` variables for `python app.py`: strings as they are, the rest as JSON."""
    return {
        f"NEURON_APP_{key.upper()}": value if isinstance(value, str) else json.dumps(value)
        for key, value in overrides.items()
        if value is not None
    }


def worker_settings(spec: dict[str, Any]) -> Any:
    """A worker's measured settings, with the Neuron environment exported before anything imports torch."""
    from neuron_app.environment import prepare_process
    from neuron_app.settings import load_settings

    settings = load_settings(**spec["settings"])
    prepare_process(settings)
    return settings


def loaded_manager(settings: Any) -> Any:
    """A `PipelineManager` on these settings, loaded."""
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(settings)
    manager.ensure_loaded()
    return manager


def worker_manager(spec: dict[str, Any]) -> Any:
    """A worker's `PipelineManager` on the spec's settings, loaded."""
    return loaded_manager(worker_settings(spec))


def timed_generate(
    manager: Any, shape: str, steps: int, seed: int, prompt: str = PROMPT, **options: Any
) -> tuple[float, Any]:
    """One `generate()` on the manager (with its keyword `options`): its wall seconds and its record."""
    start = time.perf_counter()
    record = manager.generate(prompt, shape, steps, seed, **options)
    return time.perf_counter() - start, record


def facts(manager: Any) -> dict[str, Any]:
    """What a worker's manager runs with: the compile mode and backend, the device and dtype that `auto` became."""
    return {
        "mode": manager.settings.compile_mode,
        "backend": manager.compile_backend,
        "device": manager.backend.name,
        "dtype": manager.dtype_name,
    }
