"""Bench section `aiperf` (opt-in: `--sections aiperf`): the load benchmark in the field's terms.

NVIDIA AIPerf's `image-generation` profile (the tool people compare image servers with) against the app as the
README's quick start runs it (quickstart.toml, tiny-shapes), over concurrency 1, 2, 4 and 8: requests/s and latency
p50/p99 from AIPerf's own export; queue wait from the app's `neuron_app_queue_seconds` histogram as AIPerf scraped it
from `/metrics` during the run (its count, mean and bucket estimates of p50/p99). AIPerf has no time to the first
partial image: the same concurrency through the `openai` SDK's stream (`stream: true, partial_images: 1`) measures it
here. The matched floor is the pipeline called in-process (a fresh worker, the same settings, shape and steps, the
app stopped), in the same run: latency and throughput are given as multiples of it.

AIPerf is not a dependency of the app or its tests (`requirements-aiperf.txt`, best in a virtual environment of its
own: it pins much of what it uses). The section finds it as `$AIPERF`, else `aiperf` on the PATH; without it the
section fails with that one line. AIPerf runs offline: `--tokenizer` is tiny-shapes' own tokenizer folder.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import (
    RESULT_TAG,
    BenchError,
    emit,
    facts,
    free_port,
    loaded_manager,
    ratio,
    settings_env,
    summarize,
    timed_generate,
    worker_settings,
)
from neuron_app.bench.process import Lines
from neuron_app.settings import PROJECT_ROOT

KIND = "aiperf_floor"
TITLE = "13. Load in the field's terms: NVIDIA AIPerf, image generation"
SWEEP = (1, 2, 4, 8)
QUICKSTART = PROJECT_ROOT / "quickstart.toml"
MODEL = "tiny-shapes"
TOKENIZER = PROJECT_ROOT / "neuron_app" / "models" / MODEL / "tokenizer"
#: Requests per concurrency level: `per_client` each, at least this many (p99 of fewer says little).
MIN_REQUESTS = 8
#: AIPerf's synthetic prompts, in tokens (tiny-shapes' prompts are about 20; max_sequence_length pads to 32).
PROMPT_TOKENS = 20
#: The stream's prompt: one tiny-shapes draws (the compute is the same for any prompt of the padded length).
STREAM_PROMPT = "a large red circle on a blue background"
QUEUE_METRIC = "neuron_app_queue_seconds"
DEVICE_METRIC = "neuron_app_device_seconds"
#: Floor calls before each concurrency level: the floor is measured under the load of the run it is compared with.
FLOOR_CALLS = 4
#: The floor worker says it is loaded with this prefix, then answers "time N" with FLOOR_TAG.
FLOOR_READY = "BENCH_FLOOR_READY "
FLOOR_TAG = "BENCH_FLOOR "


def aiperf_binary() -> str | None:
    """AIPerf's command: `$AIPERF`, else `aiperf` on the PATH, else None."""
    return os.environ.get("AIPERF") or shutil.which("aiperf")


def quickstart_shape() -> str:
    """The quick start's default shape (quickstart.toml), the one its first click makes."""
    return str(tomllib.loads(QUICKSTART.read_text())["default_resolution"])


def aiperf_command(binary: str, url: str, concurrency: int, count: int, shape: str, steps: int, out: Path) -> list[str]:
    """One AIPerf profile: `count` requests at `concurrency`, `concurrency` warm-up requests first (not counted)."""
    return [
        binary,
        "profile",
        *("--model", MODEL, "--url", url.rstrip("/"), "--endpoint-type", "image-generation"),
        *("--tokenizer", str(TOKENIZER), "--concurrency", str(concurrency), "--request-count", str(count)),
        *("--warmup-request-count", str(concurrency), "--prompt-input-tokens-mean", str(PROMPT_TOKENS)),
        *("--extra-inputs", json.dumps({"size": shape, "num_inference_steps": steps}), "--random-seed", "7"),
        *("--artifact-dir", str(out), "--ui-type", "none", "--no-gpu-telemetry"),
    ]


def shown_command(command: list[str]) -> str:
    """An AIPerf command as BENCHMARKS.md shows it: the local URL, paths and binary replaced by placeholders."""
    parts = ["aiperf", *command[1:]]
    for i, part in enumerate(parts[:-1]):
        following = {"--url": "http://127.0.0.1:7860", "--tokenizer": "neuron_app/models/tiny-shapes/tokenizer"}
        following["--artifact-dir"] = "artifacts/c{concurrency}"
        if part in following:
            parts[i + 1] = following[part]
        if part == "--concurrency":
            parts[i + 1] = "{1,2,4,8}"
    return " ".join(f"'{p}'" if "{" in p and '"' in p else p for p in parts)


def parse_export(folder: Path) -> dict[str, Any]:
    """One AIPerf run's figures: its summary export (profile_export_aiperf.json) and its scrape of the app's
    `/metrics` (server_metrics_export.json; absent if the scrape failed)."""
    summary = json.loads((folder / "profile_export_aiperf.json").read_text())
    latency = summary["request_latency"]
    row: dict[str, Any] = {
        "requests": int(summary["request_count"]["avg"]),
        "errors_pct": summary.get("request_error_rate", {}).get("avg", 0.0),
        "requests_per_s": summary["request_throughput"]["avg"],
        "latency_ms": {key: latency[key] for key in ("avg", "p50", "p90", "p99", "min", "max")},
        "duration_s": summary["benchmark_duration"]["avg"],
        "aiperf_version": summary.get("aiperf_version"),
    }
    path = folder / "server_metrics_export.json"
    server = json.loads(path.read_text()) if path.is_file() else {}
    missing = {"count": 0, "mean_ms": None, "p50_ms": None, "p99_ms": None}
    row["queue"] = histogram(server, QUEUE_METRIC) or missing
    row["device"] = histogram(server, DEVICE_METRIC) or missing  # the pipeline call in the app, same window
    return row


def histogram(server_metrics: dict[str, Any], name: str) -> dict[str, Any] | None:
    """One of the app's histograms over the run, as AIPerf exported its scrape: count, mean, p50 and p99 (AIPerf's
    estimates from the buckets), in ms; the series with the most observations (the run uses one shape)."""
    metric = server_metrics.get("metrics", {}).get(name)
    series = [s["stats"] for s in (metric or {}).get("series", []) if s.get("stats", {}).get("count")]
    if not series:
        return None
    stats = max(series, key=lambda s: s["count"])
    return {
        "count": int(stats["count"]),
        "mean_ms": 1000 * stats["sum"] / stats["count"],
        "p50_ms": 1000 * stats["p50_estimate"],
        "p99_ms": 1000 * stats["p99_estimate"],
    }


def stream_first_partial(url: str, concurrency: int, count: int, shape: str, steps: int) -> dict[str, Any]:
    """`count` streamed generations (`partial_images: 1`) through the `openai` SDK, `concurrency` at a time: the
    seconds to the first partial image and to the completed one, per request."""
    from openai import OpenAI

    first, done, errors, lock = [], [], [], threading.Lock()
    per_thread = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]
    barrier = threading.Barrier(concurrency)

    def work(index: int, n: int) -> None:
        client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)
        barrier.wait()
        for j in range(n):
            start, seen = time.perf_counter(), None
            try:
                stream = client.images.generate(
                    prompt=STREAM_PROMPT,
                    size=shape,  # type: ignore[arg-type]
                    stream=True,
                    partial_images=1,
                    extra_body={"num_inference_steps": steps, "seed": 100 * index + j},
                )
                for event in stream:
                    if event.type.endswith("partial_image") and seen is None:
                        seen = time.perf_counter() - start
                    elif event.type.endswith("completed"):
                        with lock:
                            first.append(seen if seen is not None else float("nan"))
                            done.append(time.perf_counter() - start)
            except Exception as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
        client.close()

    threads = [threading.Thread(target=work, args=(i, n), daemon=True) for i, n in enumerate(per_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    partial = [s for s in first if s == s]  # a completed stream without a partial image counts as missing
    return {
        "first_partial": summarize(partial),
        "completed": summarize(done),
        "missing": len(first) - len(partial),
        "errors": errors[:3],
    }


def _wait_ready(url: str, shape: str, steps: int, deadline: float) -> float:
    """Until the app answers, then its first image at `shape` (the compile): that image's seconds."""
    import httpx

    body = {"prompt": STREAM_PROMPT, "size": shape, "num_inference_steps": steps, "seed": 0}
    while time.monotonic() < deadline:
        try:
            start = time.perf_counter()
            answer = httpx.post(url + "v1/images/generations", json=body, timeout=max(1.0, deadline - time.monotonic()))
            if answer.status_code == 200:
                return time.perf_counter() - start
            if answer.status_code != 503:  # loading: try again
                raise BenchError(f"first request: HTTP {answer.status_code}: {answer.text[:300]}")
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(1.0)
    raise BenchError("the app did not answer its first request in time")


@contextlib.contextmanager
def floor_worker(harness: Any, cache: Path, env: dict[str, str], shape: str) -> Iterator[Callable[[int], list[float]]]:
    """The matched floor's process (quickstart.toml's settings, the app's cache folder: its graphs from disk), up and
    loaded; yields `floor(n)`: n pipeline calls timed in it, now (between two AIPerf runs, the app idle)."""
    spec = harness.spec(KIND, cache, shape=shape)
    spec["settings"] = {"cache_dir": str(cache), "log_level": "WARNING"}  # the rest from quickstart.toml
    with harness.process(
        harness.worker_args(spec), "aiperf-floor", env, {"exit_s": 10.0}, stdout=subprocess.PIPE, stdin=subprocess.PIPE
    ) as (proc, _log):
        lines = Lines(proc.stdout)
        ready = lines.wait_for(FLOOR_READY, time.monotonic() + harness.cfg.timeout_s)
        if "error" in ready:
            raise BenchError(ready["error"])
        harness.note_resolved(ready)

        def floor(n: int) -> list[float]:
            proc.stdin.write(f"time {n}\n")
            proc.stdin.flush()
            return lines.wait_for(FLOOR_TAG, time.monotonic() + harness.cfg.timeout_s)["samples_s"]

        yield floor
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        lines.wait_for(RESULT_TAG, time.monotonic() + 120)


def section(harness: Any) -> dict[str, Any]:
    binary = aiperf_binary()
    if binary is None:
        raise BenchError("aiperf is not installed: pip install -r requirements-aiperf.txt (or set AIPERF to it)")
    shape, steps, cache = quickstart_shape(), harness.cfg.steps, harness.new_cache("aiperf")
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    served = {"server_port": port, "server_name": "127.0.0.1", "share": False, "cache_dir": str(cache)}
    served |= {"state_dir": str(harness.cfg.out / "state" / "aiperf"), "log_level": "WARNING", "queue_max_size": 64}
    env = harness.env() | {"NEURON_APP_SETTINGS": str(QUICKSTART)}
    rows, commands, floors = [], [], []
    app_env = env | settings_env(served)
    with harness.process(
        [sys.executable, "app.py"], "aiperf-app", app_env, {"exit_s": 10.0}, stdout=subprocess.DEVNULL
    ):
        first_s = _wait_ready(url, shape, steps, time.monotonic() + harness.cfg.timeout_s)
        harness.log(f"aiperf: the app is up, its first image (the compile) took {first_s:.1f} s")
        with floor_worker(harness, cache, env, shape) as floor:
            for concurrency in SWEEP:
                before = floor(FLOOR_CALLS)  # the floor just before and just after the run: under its load
                count = max(MIN_REQUESTS, concurrency * harness.cfg.per_client)
                out = (harness.cfg.out / "aiperf" / f"c{concurrency}").resolve()  # AIPerf runs in the work folder
                shutil.rmtree(out, ignore_errors=True)
                command = aiperf_command(binary, url, concurrency, count, shape, steps, out)
                commands.append(command)
                log_path = harness.logs / f"aiperf-c{concurrency}.log"
                with log_path.open("w") as log_file:
                    done = subprocess.run(
                        command,
                        cwd=harness.work,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        timeout=harness.cfg.timeout_s,
                    )
                if done.returncode != 0:
                    raise BenchError(f"aiperf at concurrency {concurrency} exited {done.returncode} (log: {log_path})")
                row = {"concurrency": concurrency} | parse_export(out)
                row["stream"] = stream_first_partial(url, concurrency, max(2, concurrency), shape, steps)
                around = before + floor(FLOOR_CALLS)
                floors += around
                row["floor"] = summarize(around)
                row["p50_over_floor"] = ratio(row["latency_ms"]["p50"] / 1000, row["floor"]["median_s"])
                row["throughput_over_floor"] = ratio(row["requests_per_s"] * row["floor"]["median_s"], 1.0)
                rows.append(row)
                harness.log(f"aiperf: concurrency {concurrency}: {row['requests_per_s']:.2f} requests/s")
    return {
        "shape": shape,
        "steps": steps,
        "model": MODEL,
        "first_image_s": first_s,
        "floor": summarize(floors),
        "aiperf_command": shown_command(commands[0]),
        "rows": rows,
    }


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """The matched floor: the quick start's pipeline called in-process at the section's shape and steps (its graphs
    from the cache the app filled), after one warm call; on "time N", N calls timed; "quit" ends it."""
    settings = worker_settings(spec)
    manager = loaded_manager(settings)
    shape, steps = spec["shape"], spec["steps"]
    outcome = manager.compile_shape(shape)
    timed_generate(manager, shape, steps, 0, prompt=STREAM_PROMPT)
    emit(FLOOR_READY, facts(manager) | {"cache": str(outcome.cache)})
    seeds = itertools.count(1)
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["quit"]:
            break
        if command[:1] == ["time"]:
            calls = [
                timed_generate(manager, shape, steps, next(seeds), prompt=STREAM_PROMPT)[0]
                for _ in range(int(command[1]))
            ]
            emit(FLOOR_TAG, {"samples_s": calls})
    return {"calls": next(seeds) - 1}


COLUMNS = [
    ("concurrency", "concurrency"),
    ("requests", "requests"),
    ("errors %", "errors_pct", md.num),
    ("requests/s", "requests_per_s", md.num),
    ("latency p50 ms", "latency_ms.p50", md.num),
    ("latency p99 ms", "latency_ms.p99", md.num),
    ("queue wait mean ms", "queue.mean_ms", md.num),
    ("queue wait p99 ms", "queue.p99_ms", md.num),
    ("first partial p50 ms", "stream.first_partial.median_s", md.ms),
    ("stream completed p50 ms", "stream.completed.median_s", md.ms),
    ("app's pipeline call mean ms", "device.mean_ms", md.num),
    ("floor p50 ms", "floor.median_s", md.ms),
    ("p50 / floor", "p50_over_floor", md.num),
    ("requests/s x floor", "throughput_over_floor", md.num),
]


def render(sec: dict[str, Any]) -> str:
    floor = sec["floor"]
    return (
        f"The quick-start app (`NEURON_APP_SETTINGS=quickstart.toml python app.py`, model `{sec['model']}`), "
        f"shape {sec['shape']}, {sec['steps']} steps, driven by NVIDIA AIPerf "
        f"{sec['rows'][0].get('aiperf_version') or ''} at each concurrency:\n\n"
        f"```bash\n{sec['aiperf_command']}\n```\n\n"
        + md.columns(COLUMNS, sec["rows"])
        + "\n\nRequests/s and latency: AIPerf's export. Queue wait: the app's `neuron_app_queue_seconds` histogram "
        "as AIPerf scraped it from `/metrics` (p99 is AIPerf's estimate from the buckets). First partial: the same "
        "concurrency through the `openai` SDK's stream (`stream: true, partial_images: 1`, at least 2 requests), "
        "which AIPerf does not measure. The app's pipeline call: its `neuron_app_device_seconds` in the same scrape "
        "(the device lane held, in the app's process, during the run). **Matched floor**: the pipeline called "
        "in-process (a process of its own, quickstart.toml's settings, the same shape and steps), "
        f"{FLOOR_CALLS} calls right before and {FLOOR_CALLS} right after each concurrency level while the app is "
        "idle, so each row's floor saw about that row's machine load (all rows: median "
        f"{md.ms(floor['median_s'])} ms over {floor['n']} calls); `p50 / floor` is AIPerf's latency p50 over the "
        "row's floor, `requests/s x floor` the throughput over the floor's 1/floor (above 1, inferred: the app keeps "
        "the second core busy, one request's work outside the pipeline call beside the next one's call)."
    )
