"""Bench section `startup`: `python app.py` to the page answering, to the model loaded, to the first image,
lazy vs load_on_start; beside a trivial Gradio app's start (the floor for any Gradio page here).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import PROMPT, BenchError, free_port
from neuron_app.bench.process import wait_up

TITLE = "7. Start-up"


def section(harness: Any) -> dict[str, Any]:
    cache_dir, cache_note = harness.cache_for("startup", fresh=harness.parallel)
    starts = [("lazy", False), ("load_on_start", True)]
    with ThreadPoolExecutor(max_workers=harness.cfg.jobs) as pool:
        rows = list(pool.map(lambda start: _start_app(harness, *start, cache_dir), starts))
    trivial = _start_trivial_gradio(harness)
    result = {"cache_folder": cache_note, "mode": harness.cfg.serving_mode, "shape": harness.cfg.shapes[0]}
    return result | {"rows": rows, "trivial_page_s": trivial, "page_vs_trivial": rows[0]["page_s"] / trivial}


def _start_trivial_gradio(harness: Any) -> float:
    """Seconds from starting a one-textbox Gradio app to its HTTP 200: the floor for any Gradio page here."""
    port = free_port()
    code = (
        "import gradio as gr\n"
        "with gr.Blocks() as demo:\n    gr.Textbox()\n"
        f"demo.launch(server_name='127.0.0.1', server_port={port}, quiet=True)\n"
    )
    start = time.perf_counter()
    with harness.process([sys.executable, "-c", code], "startup-trivial", stdout=subprocess.DEVNULL) as (proc, _log):
        wait_up(f"http://127.0.0.1:{port}/", proc, time.monotonic() + harness.cfg.timeout_s)
        return time.perf_counter() - start


def _start_app(harness: Any, label: str, load_on_start: bool, cache_dir: Path) -> dict[str, Any]:
    import psutil

    start = time.perf_counter()
    peak = 0.0
    with harness.app(f"startup-{label}", cache_dir, load_on_start=load_on_start) as (proc, url):
        handle = psutil.Process(proc.pid)
        deadline = time.monotonic() + harness.cfg.timeout_s

        def sample() -> None:
            nonlocal peak
            with contextlib.suppress(psutil.Error):
                peak = max(peak, handle.memory_info().rss / 2**20)
            if proc.poll() is not None:
                raise BenchError(f"app.py exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise BenchError("app.py timed out")

        wait_up(url, proc, deadline, sample)
        page_s = time.perf_counter() - start
        # The first request arrives as soon as the page answers: it is what loads a lazy server.
        first: dict[str, Any] = {}
        requester = threading.Thread(target=_first_request, args=(harness, url, first, start), daemon=True)
        requester.start()
        status: dict[str, Any] = {}
        while not status.get("loaded"):
            sample()
            status = _status_http(url)
            if status.get("load_error"):
                raise BenchError(f"app.py: {status['load_error']}")
            time.sleep(0.02)
        loaded_s = time.perf_counter() - start
        while requester.is_alive():
            sample()
            requester.join(timeout=0.1)
        if "error" in first:
            raise BenchError(f"the first request: {first['error']}")
        sample()
    harness.log(f"startup {label}: page {page_s:.2f} s, loaded {loaded_s:.2f} s, image {first['first_image_s']:.2f} s")
    row = {"start": label, "page_s": page_s, "loaded_s": loaded_s, "first_image_s": first["first_image_s"]}
    return row | {"load_s": status.get("load_s"), "first_cache": first.get("cache"), "peak_rss_mb": peak}


def _first_request(harness: Any, url: str, into: dict[str, Any], start: float) -> None:
    try:
        _path, info = harness.client(url).predict(
            PROMPT, harness.cfg.shapes[0], harness.cfg.steps, 0, api_name="/generate"
        )
        into["first_image_s"] = time.perf_counter() - start
        into["cache"] = info.get("cache")
    except Exception as exc:
        into["error"] = f"{type(exc).__name__}: {exc}"


def _status_http(url: str) -> dict[str, Any]:
    """The status endpoint over plain HTTP (`/gradio_api/run/status`): cheap enough to poll."""
    request = urllib.request.Request(
        url + "gradio_api/run/status",
        data=json.dumps({"data": []}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())["data"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return {}


def render(sec: dict[str, Any]) -> str:
    columns = [
        ("start", "start"),
        ("page HTTP 200 s", "page_s", md.s),
        ("model loaded s", "loaded_s", md.s),
        ("load itself s", "load_s", md.s),
        ("first image s", "first_image_s", md.s),
        ("cache", "first_cache"),
    ]
    floor = ""
    if "trivial_page_s" in sec:  # a one-textbox Gradio app started in the same run
        floor = (
            f"\n\nA trivial Gradio app (one textbox) answered {md.s(sec['trivial_page_s'])} s after its start; "
            f"our lazy page took {md.x(sec['page_vs_trivial'])} that."
        )
    return (
        f"`python app.py`, mode {sec['mode']}, cache folder {sec['cache_folder']}; seconds from the process start. "
        f"The first request ({sec['shape']}) is sent as soon as the page answers (it is what loads a lazy server).\n\n"
        + md.columns(columns, sec["rows"])
        + floor
    )
