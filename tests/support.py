"""Helpers that test modules import (conftest.py keeps the fixtures): the project root, the tiny-model
settings, free ports, `python app.py` and the CLI in subprocesses, the probe that reads the environment at the
moment torch is first imported, the clients of the launched app, and the inpainting test pictures."""

from __future__ import annotations

import collections
import contextlib
import http.server
import io
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from neuron_app import environment
from neuron_app.bench.common import free_port as free_port  # one copy: tests import it from here

ROOT = Path(__file__).resolve().parent.parent

#: What every test's gradio_client gets: its requests but the event stream (/config, /info, uploads, the queue join)
#: wait on httpx's default 5 s, and on a busy machine the app's /info alone took longer (a `.ci/run` at stop 62). A
#: minute, as a user on a slow link would pass it (`Client(url, httpx_kwargs={"timeout": 60})`).
PATIENT_HTTP: dict[str, Any] = {"timeout": 60}

#: Small shapes: 64x64 (16 tokens), 128x64 and its transpose (32 tokens each), 128x128 (64 tokens).
TEST_SHAPES = ["64x64", "128x64", "64x128", "128x128"]
TINY_OVERRIDES: dict[str, Any] = {
    "model": "tiny",
    "device": "cpu",
    "compile_backend": "aot_eager",
    "resolutions": TEST_SHAPES,
    "default_resolution": "64x64",
    "max_sequence_length": 32,
    "max_steps": 8,
}

#: tiny-shapes, the small model trained on coloured shapes that ships in neuron_app/models (its images can be judged).
SHAPES_SIZES = ["64x64", "128x128", "256x128", "128x256"]
SHAPES_OVERRIDES: dict[str, Any] = TINY_OVERRIDES | {
    "model": "tiny-shapes",
    "resolutions": SHAPES_SIZES,
    "default_resolution": "128x128",
    "loras": {"outline": "tiny-shapes:outline"},
}

#: The Neuron variables the app exports before torch loads (what the probe below reports).
FALLBACKS = list(environment.FALLBACK_VARS)
WATCHED = [environment.NEFF_CACHE_VAR, *FALLBACKS, environment.VISIBLE_CORES_VAR]

#: `python -c PROBE % {"watched": WATCHED, "argv": [...]}` runs an entry (a script, or `-m module`) and prints
#: `PROBE {json}` of the watched variables at the moment `import torch` first runs, then exits 0.
PROBE = """
import json, os, runpy, sys
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("PROBE " + json.dumps({k: os.environ.get(k) for k in %(watched)r}), flush=True)
            os._exit(0)
        return None
sys.meta_path.insert(0, Probe())
sys.argv = %(argv)r
if sys.argv[0] == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
print("NO TORCH IMPORT", flush=True)
"""


def link_models(cache_dir: Path, models: Path) -> Path:
    """A cache folder whose `models/` is the session's one tiny-model build (a symlink, not a copy)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    link = cache_dir / "models"
    if not link.exists():
        link.symlink_to(models, target_is_directory=True)
    return cache_dir


class AppProcess:
    """`python app.py` in a subprocess (tiny model, aot_eager), its output captured in a file."""

    def __init__(self, cache_dir: Path, env: dict[str, str], log_path: Path) -> None:
        self.cache_dir = cache_dir
        self.port = int(env["NEURON_APP_SERVER_PORT"])
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_up(self, timeout: float = 90.0) -> None:
        """Until this process says it runs on its port and the port answers HTTP (401 under auth is up too)."""
        import time
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"app.py exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            if f"127.0.0.1:{self.port}" not in self.output():
                time.sleep(0.2)
                continue
            try:
                urllib.request.urlopen(self.url + "gradio_api/info", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"app.py did not answer within {timeout} s:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """The first truthy value of `predicate`, polled every 0.2 s; fails naming `what` after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def http_answer(sock: socket.socket) -> bytes:
    """One HTTP answer read whole from a raw socket: the head, then as many body bytes as its Content-Length says.
    A single `recv` is not an answer: on a busy machine the head and the body came in two reads (.ci/run beside a
    second suite: a 429's head without its `queue_full` body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        if not (chunk := sock.recv(65536)):
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:[ \t]*(\d+)", head)
    while length and len(body) < int(length.group(1)) and (chunk := sock.recv(65536)):
        body += chunk
    return head + b"\r\n\r\n" + body


def http_status(sock: socket.socket) -> str:
    """The status code of the answer on a raw socket ("200", "429"...), or "closed" when the server closed (or
    reset) it first; reads the 12 bytes of `HTTP/1.1 NNN` however many reads they take."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while len(data) < 12 and (chunk := sock.recv(12 - len(data))):
            data += chunk
    return data[9:12].decode() or "closed"


class SlowBodies:
    """The slow-body attacker (red-team rows 1, 3 and 33), scaled down: keeps `count` connections from `addresses`
    open to the app on `port`, each a POST's headers promising 100 kB and then a byte now and then; a connection the
    server answers (503, 408) or closes is counted and replaced at once, until `stop` is set or `most` were opened."""

    def __init__(self, port: int, count: int, addresses: list[str], most: int | None = None) -> None:
        self.port, self.count, self.addresses, self.most = port, count, addresses, most
        self.stop, self.opened, self.answered = threading.Event(), 0, collections.Counter()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def open_one(self) -> socket.socket:
        address = self.addresses[self.opened % len(self.addresses)]
        sock = socket.create_connection(("127.0.0.1", self.port), 120.0, (address, 0))
        self.opened += 1
        head = b"POST /gradio_api/call/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Content-Length: 100000\r\n\r\n{")
        return sock

    def run(self) -> None:
        held: list[socket.socket] = []
        try:
            while not self.stop.is_set() and (self.most is None or self.opened < self.most):
                while len(held) < self.count:
                    held.append(self.open_one())
                readable, _, _ = select.select(held, [], [], 0.5)
                for sock in readable:
                    with contextlib.suppress(OSError):
                        self.answered[http_status(sock)] += 1
                    held.remove(sock)
                    sock.close()
                for sock in held[:2]:
                    with contextlib.suppress(OSError):
                        sock.sendall(b" ")
        finally:
            for sock in held:
                sock.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


#: Ray gives a new node's raylet 30 s to register with the GCS (ray/_private/node.py, a constant) and then exits
#: with this; on a loaded machine the GCS answered later than that (.ci/run beside a second suite, load average 21).
RAY_START_TIMED_OUT = b"The current node timed out during startup"


@contextlib.contextmanager
def ray_head(folder: Path, tries: int = 3) -> Iterator[str]:
    """`ray start --head --block` with 2 CPUs on free ports (Ray's defaults, 10001 and 52365, may be taken): an
    already running cluster that an app joins through `ray_address`; ended through its own process group (raylet,
    GCS and workers are in it). A start that ran out of Ray's own 30 s is made again, up to `tries` times. Yields
    its address."""
    import signal

    def start(log_path: Path) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}"]
        command += [f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}"]
        command += ["--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"]
        env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0"}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        started = lambda: b"Ray runtime started" in log_path.read_bytes()  # noqa: E731
        try:
            wait_for(lambda: started() or proc.poll() is not None, 180, "ray start --head")  # a loaded machine is slow
        except AssertionError:
            end(proc)  # neither started nor exited: its process group goes with the failure
            raise
        return proc, port

    def end(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    for attempt in range(1, tries + 1):
        log_path = folder / f"ray-start-{attempt}.log"
        proc, port = start(log_path)
        if proc.poll() is None:
            break
        end(proc)  # the GCS or raylet it may have left
        if RAY_START_TIMED_OUT not in log_path.read_bytes() or attempt == tries:
            raise AssertionError(log_path.read_text()[-4000:])
    try:
        yield f"127.0.0.1:{port}"
    finally:
        end(proc)


# --- the CLI in a subprocess (tiny settings from NEURON_APP_* variables) ---------------------------------------


@contextlib.contextmanager
def steps_held(manager: Any, hold: Callable[[int, int], threading.Event | None], wait_s: float) -> Iterator[list[Any]]:
    """The manager's requests run for real, but after step `number` of its `count`-th request (from 1) the step
    callback waits on the event `hold(count, number)` gives (None: it goes on), for at most `wait_s`: a browser test
    waits on the page, never races the steps (a busy machine ran them all before the page drew one). Yields the
    requests' calls; the caller sets its events, the manager is restored on the way out."""
    original, calls = manager._execute, []

    def held(call: Any, on_step: Any = None) -> Any:
        if on_step is None:  # a compile's warm-up call, not a request
            return original(call)
        calls.append(call)
        count = len(calls)

        def step(number: int, total: int, preview: Any = None) -> None:
            on_step(number, total, preview)
            if (event := hold(count, number)) is not None:
                event.wait(wait_s)

        return original(call, step)

    manager._execute = held
    try:
        yield calls
    finally:
        manager._execute = original


def tiny_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    env.update(
        PYTHONPATH=str(ROOT),
        NEURON_APP_MODEL="tiny",
        NEURON_APP_DEVICE="cpu",
        NEURON_APP_COMPILE_BACKEND="aot_eager",
        NEURON_APP_RESOLUTIONS=json.dumps(TEST_SHAPES),
        NEURON_APP_DEFAULT_RESOLUTION="64x64",
        NEURON_APP_MAX_SEQUENCE_LENGTH="32",
        NEURON_APP_CACHE_DIR=str(cache_dir),
    )
    env.update(extra)
    return env


def run_cli(env: dict[str, str], *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuron_app", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- clients of a launched app --------------------------------------------------------------------------------


def openai_client(app: Any, key: str = "unused", timeout: float = 300) -> Any:
    """The official `openai` SDK pointed at a launched app's /v1 (no retries: a test sees the first answer)."""
    from openai import OpenAI

    return OpenAI(base_url=app.url + "v1", api_key=key, max_retries=0, timeout=timeout)


def mcp_image(result: Any) -> bytes:
    """The image an MCP image tool made: its result's `resource_link` followed, as a client does (the inline
    image is a preview, web/mcp/results.py)."""
    import httpx

    (link,) = [c for c in result.content if c.type == "resource_link"]
    answer = httpx.get(str(link.uri), timeout=60)
    answer.raise_for_status()
    return answer.content


def page_generate(
    app: Any,
    data: list[Any],
    timeout: float = 60.0,
    style: tuple[Any, Any] = ("none", 1.0),
    more: tuple[Any, ...] = (),
) -> dict[str, Any]:
    """Send the page's own Generate event (private to the API, sent by the browser through the queue).
    `data` is prompt, resolution, steps, seed, images, randomize; `style` the LoRA dropdown and scale slider; then
    no reference images (and no reference buckets), no image in the brush editor, strength 1; then `more`: the
    further style and scale pairs (web/page/lora_controls.py), those not given left at none."""
    from neuron_app.bench.wire import WireClient

    fn_index = next(fid for fid, fn in app.demo.fns.items() if fn.name == "ui_generate")
    sent = [*data, *style, None, [], None, 1.0, *more]
    pairs = len(app.demo.fns[fn_index].inputs) - len(sent)
    wire = WireClient(app.url, timeout=timeout)
    try:
        return wire.event(fn_index, sent + ["none", 1.0] * (pairs // 2))
    finally:
        wire.close()


# --- inpainting pictures: a smooth source, OpenAI's mask (transparent = edit), the two halves ------------------


PICTURE_SIZE = 64


def source_image(size: int = PICTURE_SIZE) -> Image.Image:
    """A smooth, non-flat picture: a generated image cannot equal it by chance."""
    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb, "RGB")


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def left_half_mask(size: int = PICTURE_SIZE) -> bytes:
    """OpenAI's rule: fully transparent = edit. Left half transparent, right half opaque."""
    alpha = np.full((size, size), 255, np.uint8)
    alpha[:, : size // 2] = 0
    rgba = np.dstack([np.zeros((size, size, 3), np.uint8), alpha])
    return png(Image.fromarray(rgba, "RGBA"))


def halves(image: Any) -> tuple[np.ndarray, np.ndarray]:
    """The left half away from the feathered edge (the edit), and the right half (kept)."""
    from neuron_app.engine.modes.masks import FEATHER_PX

    pixels = np.asarray(image.convert("RGB")).astype(np.int16)
    return pixels[:, : PICTURE_SIZE // 2 - FEATHER_PX], pixels[:, PICTURE_SIZE // 2 :]


# --- a collector stand-in for the traces tests -------------------------------------------------------------


class OtlpReceiver(http.server.ThreadingHTTPServer):
    """A collector stand-in: OTLP over HTTP, protobuf bodies on /v1/traces, decoded with the OTLP protos."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.got = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        outer.spans.extend(scope.spans)
                outer.got.set()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                return None

        super().__init__(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def guard_of(app: Any) -> Any:
    """The `web.guard.Guard` in a launched server's middleware stack (Starlette builds the stack at its first
    request: one is sent first)."""
    import httpx

    from neuron_app.web.guard import Guard

    httpx.get(app.url + "healthz", timeout=30)
    layer = app.demo.server_app.middleware_stack
    while not isinstance(layer, Guard):
        layer = layer.app
    return layer
