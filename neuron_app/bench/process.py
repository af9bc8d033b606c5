"""Process plumbing of the orchestrator: a subprocess's tagged lines, its page answering, ending a process group,
a log's tail, and what machine the numbers were measured on."""

from __future__ import annotations

import contextlib
import os
import platform
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuron_app.bench.common import BenchError, parse_tagged
from neuron_app.environment import dist_version


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on; read without importing torch."""
    import psutil

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "versions": {
            name: dist_version(name)
            for name in ("torch", "diffusers", "transformers", "gradio", "gradio_client", "torch-neuronx", "neuronx-cc")
        },
    }


class Lines:
    """A subprocess's stdout read by a thread, so waiting for a line can time out."""

    def __init__(self, stream: Any) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)

    def wait_for(self, tag: str, deadline: float) -> dict[str, Any]:
        while True:
            try:
                line = self.queue.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"no {tag.strip()} line before the timeout") from None
            if line is None:
                raise BenchError(f"the process ended without a {tag.strip()} line")
            found = parse_tagged(line, tag)
            if found is not None:
                return found


def wait_up(url: str, proc: subprocess.Popen[Any], deadline: float, tick: Callable[[], None] | None = None) -> None:
    """Until `url` answers 200 (polled every 20 ms, 2 s at most each, `tick` run between polls); BenchError if the
    process ends or the deadline (of `time.monotonic`) passes first."""
    while True:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        if proc.poll() is not None:
            raise BenchError(f"the process exited with {proc.returncode} before {url} answered")
        if time.monotonic() > deadline:
            raise BenchError(f"{url} did not answer before the timeout")
        if tick is not None:
            tick()
        time.sleep(0.02)


def stop_group(
    proc: subprocess.Popen[Any], exit_s: float = 0.0, grace_s: float = 10.0, leader_only: bool = False
) -> None:
    """End a process we started, with its children (inductor's compile workers), by its group id.

    The group is signalled only while its leader is not yet reaped, so the id is still ours.
    `exit_s` first gives a process that is finishing on its own the time to do so; `leader_only` asks the leader
    alone to stop (app.py then drains, stops its replicas and its Ray instance), the group is killed if it hangs.
    """
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=exit_s)
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if leader_only:
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)


def log_tail(path: Path, lines: int = 6) -> str:
    """The last non-empty lines of a log, on one line: what a failed section's message quotes."""
    with contextlib.suppress(OSError):
        tail = [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
        return " | ".join(line.strip()[:200] for line in tail)
    return ""
