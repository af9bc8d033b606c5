"""Small pieces shared by the orchestrator and the workers: statistics, the line protocol, ports."""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

#: A worker's final answer is one stdout line with this prefix; anything else on stdout is ignored.
RESULT_TAG = "BENCH_RESULT "
#: The serving worker announces that the app answers with this prefix, then waits for "quit".
READY_TAG = "BENCH_READY "
#: The serving worker's answer to "direct SEED": one generation timed on the manager, in the server process.
DIRECT_TAG = "BENCH_DIRECT "

PROMPT = "A lighthouse on a cliff at dawn, volumetric light"
OTHER_PROMPT = "A watercolor fox reading a book under a cherry tree"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy: the parent never imports torch."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


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


def emit(tag: str, payload: dict[str, Any]) -> None:
    """One tagged JSON line on stdout: the only channel from a worker to the orchestrator."""
    sys.stdout.write(tag + json.dumps(payload) + "\n")
    sys.stdout.flush()


def parse_tagged(line: str, tag: str) -> dict[str, Any] | None:
    return json.loads(line[len(tag) :]) if line.startswith(tag) else None


def free_port() -> int:
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
