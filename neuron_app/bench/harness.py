"""The orchestrator: runs each section's subprocesses in order and gathers one results dict.

Sections share what one of them built when that is not what the other measures: the cache
folder filled by the cold run of the serving mode is reused (and said to be reused) by the
warm restart, the recompile sequence, the server and the start-up runs, so only the
measurements that are about a cold compile pay for one.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from neuron_app.bench import SCHEMA_VERSION
from neuron_app.bench.common import (
    DIRECT_TAG,
    PROMPT,
    READY_TAG,
    RESULT_TAG,
    BenchError,
    ShareOfOthers,
    free_port,
    good_result,
    http_ok,
    ratio,
    settings_env,
    summarize,
)
from neuron_app.bench.process import Lines, log_tail, machine_info, stop_group
from neuron_app.bench.sections import lora
from neuron_app.engine.tiny import VARIANTS
from neuron_app.settings import PROJECT_ROOT
from neuron_app.shapes import Resolution

#: Preference order for the mode that a server runs (the app's default first).
SERVING_MODES = ("full", "regional", "eager")


@dataclass
class BenchConfig:
    model: str
    device: str
    shapes: list[str]
    steps: int
    modes: list[str]
    backend: str | None
    repeats: int
    clients: list[int]
    per_client: int
    seq_len: int
    sections: list[str]
    recompile_shapes: list[str]
    timeout_s: float
    out: Path
    command: str
    jobs: int = 1
    threads: int | None = None
    models_dir: Path | None = field(default=None, repr=False)
    smoke: bool = False
    keep_work: bool = False
    replicas_shape: str | None = None

    @property
    def is_tiny(self) -> bool:
        return self.model in VARIANTS

    @property
    def serving_mode(self) -> str:
        return next(m for m in SERVING_MODES if m in self.modes)

    @property
    def all_shapes(self) -> list[str]:
        return list(dict.fromkeys(self.shapes + self.recompile_shapes))

    def public(self) -> dict[str, Any]:
        """The configuration as it goes into the results (no local paths)."""
        data = asdict(self)
        for key in ("out", "command", "keep_work", "models_dir"):
            data.pop(key)
        return data


class Harness:
    def __init__(self, config: BenchConfig) -> None:
        self.cfg = config
        self.logs = config.out / "logs"
        self.work = Path(tempfile.mkdtemp(prefix="neuron-app-bench-"))
        self.models = config.models_dir or self.work / "models"
        self.results: dict[str, Any] = {}
        self.resolved: dict[str, Any] = {}
        #: A cache folder already filled for the serving mode, and which run filled it.
        self.warm_cache: tuple[Path, str] | None = None
        self._worker_ids = itertools.count(1)

    # --- plumbing --------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    def new_cache(self, name: str) -> Path:
        """An empty cache folder; the tiny model is shared through a link, as the tests do."""
        folder = self.work / name / "cache"
        folder.mkdir(parents=True, exist_ok=True)
        if self.cfg.is_tiny:
            (folder / "models").symlink_to(self.models, target_is_directory=True)
        return folder

    def settings(self, mode: str, cache_dir: Path, **extra: Any) -> dict[str, Any]:
        """Overrides for `load_settings`: everything that matters is explicit, nothing left to settings.toml."""
        shapes = self.cfg.all_shapes
        data: dict[str, Any] = {
            "model": self.cfg.model,
            "device": self.cfg.device,
            "compile_mode": mode,
            "compile_backend": self.cfg.backend,
            "resolutions": shapes,
            "default_resolution": shapes[0],
            "max_sequence_length": self.cfg.seq_len,
            "max_steps": max(16, self.cfg.steps + 1),
            "default_steps": self.cfg.steps,
            "cache_dir": str(cache_dir),
            "load_on_start": False,
            "warmup": "none",
            "only_precompiled": False,
            "log_level": "WARNING",
        }
        return data | extra

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
        env["GRADIO_ANALYTICS_ENABLED"] = "False"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        threads = 1 if self.parallel else self.cfg.threads  # side by side, extra threads only spin
        if threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        return env

    def _popen(
        self, args: list[str], name: str, env: dict[str, str] | None = None, **kwargs: Any
    ) -> tuple[subprocess.Popen[str], Path]:
        """Start a process in its own group; its stderr goes to a log file named after it."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{next(self._worker_ids):02d}-{name}.log"
        log_file = log_path.open("w")
        proc = subprocess.Popen(
            args,
            cwd=PROJECT_ROOT,
            env=env or self._env(),
            stderr=log_file,
            text=True,
            start_new_session=True,  # its own process group: stopped as a whole, by id
            **kwargs,
        )
        log_file.close()
        return proc, log_path

    def worker_args(self, spec: dict[str, Any]) -> list[str]:
        return [sys.executable, "-m", "neuron_app.bench", "_worker", json.dumps(spec)]

    def run_worker(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Run one measurement in a fresh process; its answer, or `BenchError` with the reason."""
        start = time.perf_counter()
        proc, log_path = self._popen(self.worker_args(spec), name, stdout=subprocess.PIPE)
        try:
            result = Lines(proc.stdout).wait_for(RESULT_TAG, time.monotonic() + self.cfg.timeout_s)
        except BenchError as exc:
            raise BenchError(f"{name}: {exc}; log {log_path}: {log_tail(log_path)}") from None
        finally:
            stop_group(proc, exit_s=10.0)
        if "error" in result:
            raise BenchError(f"{name}: {result['error']} (log: {log_path})")
        self._note_resolved(result)
        self.log(f"{name}: done in {time.perf_counter() - start:.1f} s")
        return result | {"wall_s": time.perf_counter() - start}

    def _note_resolved(self, result: dict[str, Any]) -> None:
        """What `auto` and the default backend became, as the workers saw it (the parent never imports torch)."""
        if "device" in result and not self.resolved:
            self.resolved.update(device=result["device"], dtype=result["dtype"], compile_backend=result["backend"])

    # --- sections -------------------------------------------------------------------------------
    @property
    def parallel(self) -> bool:
        return self.cfg.jobs > 1

    def prepare(self) -> None:
        if self.cfg.is_tiny and not (self.models / VARIANTS[self.cfg.model].folder_name / "model_index.json").is_file():
            self.models.mkdir(parents=True, exist_ok=True)
            self.run_worker("prepare", {"kind": "prepare", "models_dir": str(self.models), "variant": self.cfg.model})

    def measure_mode(self, mode: str, cache_dir: Path, name: str) -> dict[str, Any]:
        spec = {
            "kind": "measure",
            "settings": self.settings(mode, cache_dir),
            "shapes": self.cfg.shapes,
            "steps": self.cfg.steps,
            "repeats": self.cfg.repeats,
        }
        result = self.run_worker(name, spec)
        if mode == self.cfg.serving_mode:
            self.warm_cache = (cache_dir, name)
        return result

    def section_modes(self) -> dict[str, Any]:
        """Eager vs full vs regional: a fresh process and an empty cache folder each."""

        def one(mode: str) -> dict[str, Any]:
            return self.measure_mode(mode, self.new_cache(f"mode-{mode}"), f"modes-{mode}")

        with ThreadPoolExecutor(max_workers=self.cfg.jobs) as pool:
            runs = dict(zip(self.cfg.modes, pool.map(one, self.cfg.modes), strict=True))
        ratios: dict[str, Any] = {}
        if "full" in runs and "regional" in runs:
            for shape in self.cfg.shapes:
                full, regional = runs["full"]["shapes"][shape], runs["regional"]["shapes"][shape]
                ratios[shape] = {
                    "compile_regional_over_full": ratio(regional["compile_s"], full["compile_s"]),
                    "latency_regional_over_full": ratio(regional["steady"]["median_s"], full["steady"]["median_s"]),
                }
        return {"runs": runs, "ratios": ratios}

    def section_restart(self) -> dict[str, Any]:
        """Cold (empty cache folder) vs warm (the same folder, a new process): time to first image."""
        mode = self.cfg.serving_mode
        modes = self.results.get("modes", {})
        if modes.get("status") == "ok" and mode in modes["runs"]:
            cold, cold_dir, source = modes["runs"][mode], self.work / f"mode-{mode}" / "cache", f"modes-{mode}"
        else:
            cold_dir = self.new_cache("restart")
            cold, source = self.measure_mode(mode, cold_dir, "restart-cold"), "restart-cold"
        warm = self.measure_mode(mode, cold_dir, "restart-warm")
        rows = []
        for shape in self.cfg.shapes:
            c, w = cold["shapes"][shape], warm["shapes"][shape]
            rows.append(
                {
                    "shape": shape,
                    "cold_first_image_s": c["first_image_s"],
                    "warm_first_image_s": w["first_image_s"],
                    "warm_over_cold": ratio(w["first_image_s"], c["first_image_s"]),
                    "cold_cache": c["cache"],
                    "warm_cache": w["cache"],
                    "cold_compile_s": c["compile_s"],
                    "warm_compile_s": w["compile_s"],
                }
            )
        return {
            "mode": mode,
            "cold_run": source,
            "cold": _process_times(cold),
            "warm": _process_times(warm),
            "rows": rows,
        }

    def _cache_for(self, name: str, fresh: bool = False) -> tuple[Path, str]:
        """The serving mode's filled cache folder if there is one (and `fresh` is not asked), else a new one."""
        if self.warm_cache is not None and not fresh:
            return self.warm_cache[0], f"reused (filled by {self.warm_cache[1]})"
        folder = self.new_cache(name)
        if not fresh:
            self.warm_cache = (folder, name)
        return folder, "empty"

    def family_shapes(self) -> tuple[list[str], int, int]:
        """The seven default shapes and VAE tile, or for the tiny models all of them divided by 4 (every side
        stays a multiple of 16 and the three token families stay families); the smoke run: three small shapes."""
        from neuron_app.settings import Settings

        defaults = Settings.model_fields
        shapes = list(defaults["resolutions"].default)
        tile, overlap = defaults["vae_tile"].default, defaults["vae_tile_overlap"].default
        if self.cfg.smoke:
            return ["64x64", "128x64", "64x128"], 8, 2
        if self.cfg.is_tiny:
            shapes = [f"{r.width // 4}x{r.height // 4}" for r in map(Resolution.parse, shapes)]
            tile, overlap = tile // 4, overlap // 4
        return shapes, tile, overlap

    def section_families(self) -> dict[str, Any]:
        """Graphs compiled for the default shapes: the VAE compiled per latent shape (what a static-shape
        compiler pays today) beside the tiled VAE (one graph); and the prompt cache's saving."""
        shapes, tile, overlap = self.family_shapes()
        mode = "full" if "full" in self.cfg.modes else self.cfg.serving_mode
        paths = {}
        for path in ("whole-vae", "tiled-vae"):
            extra = {"resolutions": shapes, "default_resolution": shapes[0], "vae_tile": tile}
            extra |= {"vae_tile_overlap": overlap, "vae_compile": "on" if path == "tiled-vae" else "off"}
            spec = {
                "kind": "families",
                "path": path,
                "settings": self.settings(mode, self.new_cache(f"families-{path}"), **extra),
                "shapes": shapes,
                "steps": self.cfg.steps,
                "repeats": self.cfg.repeats,
            }
            paths[path] = self.run_worker(f"families-{path}", spec)
        families = len({Resolution.parse(s).image_tokens for s in shapes})
        tiled = paths["tiled-vae"]
        return {
            "shapes": shapes,
            "tile": tile,
            "overlap": overlap,
            "mode": mode,
            "families": families,
            "paths": paths,
            "ok": tiled["transformer_graphs"] == families and tiled["vae_graphs"] == 1,
        }

    def section_recompile(self) -> dict[str, Any]:
        a, b = self.cfg.recompile_shapes[0], self.cfg.recompile_shapes[-1]
        cache_dir, cache_note = self._cache_for("recompile", fresh=self.parallel)
        spec = {
            "kind": "sequence",
            "settings": self.settings(self.cfg.serving_mode, cache_dir),
            "shape_a": a,
            "shape_b": b,
            "steps": self.cfg.steps,
        }
        result = self.run_worker("recompile", spec)
        expected = result["distinct_graph_keys"]
        result["expected_compiles"] = expected
        result["ok"] = result["compile_events"] == expected and result["compile_failures"] == 0
        result["cache_folder"] = cache_note
        return result

    def section_edit(self) -> dict[str, Any]:
        """Editing: compile seconds and latency for 0, 1 and 2 references at one output shape, fresh cache."""
        shape = self.cfg.shapes[0]
        others = [s for s in self.cfg.all_shapes if s != shape]
        spec = {
            "kind": "edit",
            "settings": self.settings(self.cfg.serving_mode, self.new_cache("edit")),
            "shape": shape,
            "steps": self.cfg.steps,
            "repeats": self.cfg.repeats,
            "references": [0, 1, 2],
            "warm_shape": others[0] if others else None,
        }
        result = self.run_worker("edit", spec)
        base = result["rows"][0]
        for row in result["rows"]:
            row["compile_over_0"] = ratio(row["compile_s"], base["compile_s"])
            row["latency_over_0"] = ratio(row["steady"]["median_s"], base["steady"]["median_s"])
        return result | {"shape": shape, "steps": self.cfg.steps, "warm_shape": spec["warm_shape"]}

    @contextlib.contextmanager
    def server(self) -> Iterator[dict[str, Any]]:
        """The serving worker, up and answering; yields its ready message, then its final answer."""
        cache_dir, cache_note = self._cache_for("serve", fresh=self.parallel)
        port = free_port()
        max_clients = max(self.cfg.clients, default=1)
        spec = {
            "kind": "serve",
            "settings": self.settings(
                self.cfg.serving_mode,
                cache_dir,
                server_port=port,
                server_name="127.0.0.1",
                share=False,
                concurrency_limit=1,
                queue_max_size=max(16, 2 * max_clients),
            ),
            "shape": self.cfg.shapes[0],
            "steps": self.cfg.steps,
            "repeats": self.cfg.repeats,
        }
        proc, log_path = self._popen(self.worker_args(spec), "serve", stdout=subprocess.PIPE, stdin=subprocess.PIPE)
        info: dict[str, Any] = {"cache_folder": cache_note}
        try:
            lines = Lines(proc.stdout)
            ready = lines.wait_for(READY_TAG, time.monotonic() + self.cfg.timeout_s)
            if "error" in ready:
                raise BenchError(f"serve: {ready['error']}")
            info.update(ready)
            self._note_resolved(ready)

            def direct(seed: int) -> float:
                proc.stdin.write(f"direct {seed}\n")
                proc.stdin.flush()
                return lines.wait_for(DIRECT_TAG, time.monotonic() + self.cfg.timeout_s)["s"]

            info["direct"] = direct
            yield info
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            final = lines.wait_for(RESULT_TAG, time.monotonic() + 120)
            if "error" in final:
                raise BenchError(f"serve: {final['error']}")
            info["final"] = final
        except BenchError as exc:
            raise BenchError(f"{exc}; log {log_path}: {log_tail(log_path)}") from None
        finally:
            stop_group(proc, exit_s=10.0)

    def client(self, url: str) -> Any:
        from gradio_client import Client

        downloads = self.work / "downloads"
        downloads.mkdir(exist_ok=True)
        # gradio_client opens a new httpx client, with a new TLS context (the CA bundle parsed again), for every
        # HTTP call, even to an http:// URL: 8 bench clients then took more than one of this machine's two cores
        # from the server under test. On plain http there is no TLS to verify, so skip building it.
        plain = url.startswith("http://")
        return Client(url, verbose=False, download_files=str(downloads), analytics_enabled=False, ssl_verify=not plain)

    def measure_serving(self, server: dict[str, Any]) -> dict[str, Any]:
        """The same ready shape on the manager and through gradio_client, interleaved; then the status round trip.

        The floor is `/floor`, a text endpoint on the same server. gradio_client reads its message queue every
        50 ms, so its round trips come in steps; the same calls are also timed on the wire (`WireClient`, no
        polling), where `/floor` also sleeps as long as the generate before it took in the manager (`total_s`):
        generate minus that matched floor is what serving an image adds.
        """
        from neuron_app.bench.wire import WireClient

        shape, steps = self.cfg.shapes[0], self.cfg.steps
        client, wire = self.client(server["url"]), WireClient(server["url"])
        client.predict(PROMPT, shape, steps, 0, api_name="/generate")  # warm the connection and the queue
        wire.call("generate", PROMPT, shape, steps, 0, "none", 1.0, download=True)
        via_app, direct, floor, bad = [], [], [], 0
        wire_generate, wire_floor, wire_matched = [], [], []
        client.predict(0, api_name="/floor")
        for seed in range(1, self.cfg.repeats + 1):
            start = time.perf_counter()
            client.predict(0, api_name="/floor")
            floor.append(time.perf_counter() - start)
            direct.append(server["direct"](seed))
            start = time.perf_counter()
            path, info = client.predict(PROMPT, shape, steps, seed, api_name="/generate")
            via_app.append(time.perf_counter() - start)
            bad += not good_result(path, info, shape, seed)
            wire_floor.append(wire.call("floor", 0)[0])
            took, (_image, wire_info) = wire.call("generate", PROMPT, shape, steps, seed, "none", 1.0, download=True)
            wire_generate.append(took)
            bad += not (wire_info.get("seed") == seed and wire_info.get("resolution") == shape)
            wire_matched.append(wire.call("floor", 1000 * float(wire_info["total_s"]))[0])
        wire.close()
        client.predict(api_name="/status")
        status = []
        for _ in range(max(self.cfg.repeats, 10)):
            start = time.perf_counter()
            client.predict(api_name="/status")
            status.append(time.perf_counter() - start)
        direct, app = summarize(direct), summarize(via_app)
        on_wire = {"generate": summarize(wire_generate), "floor": summarize(wire_floor)}
        on_wire["matched_floor"] = summarize(wire_matched)
        return {
            "shape": shape,
            "steps": steps,
            "mode": server["mode"],
            "backend": server["backend"],
            "cache_folder": server["cache_folder"],
            "server_compile": server["compile"],
            "direct": direct,
            "via_app": app,
            "status_rtt": summarize(status),
            "floor_rtt": summarize(floor),
            "wire": on_wire,
            # what serving an image adds to a text endpoint whose handler takes as long, with no client polling
            "wire_above_matched_floor_ms": 1000
            * (on_wire["generate"]["median_s"] - on_wire["matched_floor"]["median_s"]),
            "overhead_above_floor_ms": 1000 * (app["median_s"] - direct["median_s"] - summarize(floor)["median_s"]),
            "overhead_median_ms": 1000 * (app["median_s"] - direct["median_s"]),
            "overhead_p95_ms": 1000 * (app["p95_s"] - direct["p95_s"]),
            "bad_results": bad,
        }

    def measure_concurrency(self, server: dict[str, Any]) -> dict[str, Any]:
        """K clients, each with its own connection, hammering one ready shape; every request accounted for."""
        shape, steps = self.cfg.shapes[0], self.cfg.steps
        rows = []
        for k in self.cfg.clients:
            row = self._run_clients(server["url"], k, shape, steps)
            rows.append(row)
            self.log(f"concurrency: {k} client(s): {row['ok']}/{row['sent']} ok in {row['wall_s']:.2f} s")
        return {"shape": shape, "steps": steps, "per_client": self.cfg.per_client, "rows": rows}

    def _run_clients(self, url: str, k: int, shape: str, steps: int, per_client: int | None = None) -> dict[str, Any]:
        per_client = per_client or self.cfg.per_client
        clients = [self.client(url) for _ in range(k)]  # connected before the clock starts
        outcomes: list[tuple[str, float]] = []
        lock = threading.Lock()
        barrier = threading.Barrier(k + 1)

        def work(index: int, client: Any) -> None:
            barrier.wait()
            for j in range(per_client):
                seed = 1000 * (index + 1) + j
                start = time.perf_counter()
                try:
                    path, info = client.predict(PROMPT, shape, steps, seed, api_name="/generate")
                    kind = "ok" if good_result(path, info, shape, seed) else "bad"
                except Exception:
                    kind = "error"
                with lock:
                    outcomes.append((kind, time.perf_counter() - start))

        threads = [threading.Thread(target=work, args=(i, c), daemon=True) for i, c in enumerate(clients)]
        for thread in threads:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        deadline = time.monotonic() + self.cfg.timeout_s
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        wall = time.perf_counter() - start
        with lock:
            done = list(outcomes)
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()
        sent = k * per_client
        ok = [t for kind, t in done if kind == "ok"]
        errors = sum(1 for kind, _ in done if kind != "ok")
        return {
            "clients": k,
            "sent": sent,
            "ok": len(ok),
            "errors": errors,
            "lost": sent - len(ok) - errors,  # neither answered nor refused before the timeout
            "wall_s": wall,
            "images_per_s": len(ok) / wall if wall > 0 else None,
            "latency": summarize(ok),
        }

    def section_memory(self) -> dict[str, Any]:
        rows = []
        for mode, run in self.results.get("modes", {}).get("runs", {}).items():
            rows.append({"process": f"worker, {mode}", "mode": mode, "peak_rss_mb": run["peak_rss_mb"]})
        serve = self.results.get("serving", {}).get("server", {})
        if "peak_rss_mb" in serve:
            mode = self.cfg.serving_mode
            rows.append({"process": "app server (after serving)", "mode": mode, "peak_rss_mb": serve["peak_rss_mb"]})
        for row in self.results.get("startup", {}).get("rows", []):
            rows.append(
                {
                    "process": f"python app.py ({row['start']}, sampled)",
                    "mode": self.cfg.serving_mode,
                    "peak_rss_mb": row["peak_rss_mb"],
                }
            )
        if not rows:
            raise BenchError("no process was measured: run the modes, serving or startup sections with memory")
        return {"rows": rows}

    def section_startup(self) -> dict[str, Any]:
        """`python app.py` to the page answering, to the model loaded, to the first image: lazy vs load_on_start."""
        cache_dir, cache_note = self._cache_for("startup", fresh=self.parallel)
        starts = [("lazy", False), ("load_on_start", True)]
        with ThreadPoolExecutor(max_workers=self.cfg.jobs) as pool:
            rows = list(pool.map(lambda start: self._start_app(*start, cache_dir), starts))
        trivial = self._start_trivial_gradio()
        return {
            "cache_folder": cache_note,
            "mode": self.cfg.serving_mode,
            "shape": self.cfg.shapes[0],
            "rows": rows,
            "trivial_page_s": trivial,
            "page_vs_trivial": rows[0]["page_s"] / trivial,
        }

    def _start_trivial_gradio(self) -> float:
        """Seconds from starting a one-textbox Gradio app to its HTTP 200: the floor for any Gradio page here."""
        port = free_port()
        code = (
            "import gradio as gr\n"
            "with gr.Blocks() as demo:\n    gr.Textbox()\n"
            f"demo.launch(server_name='127.0.0.1', server_port={port}, quiet=True)\n"
        )
        start = time.perf_counter()
        proc, log_path = self._popen([sys.executable, "-c", code], "startup-trivial", stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + self.cfg.timeout_s
            while not http_ok(f"http://127.0.0.1:{port}/"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BenchError(f"trivial Gradio app did not answer: {log_tail(log_path)}")
                time.sleep(0.02)
            return time.perf_counter() - start
        finally:
            stop_group(proc)

    def _start_app(self, label: str, load_on_start: bool, cache_dir: Path) -> dict[str, Any]:
        import psutil

        port = free_port()
        env = self._env() | settings_env(
            self.settings(
                self.cfg.serving_mode,
                cache_dir,
                server_port=port,
                server_name="127.0.0.1",
                share=False,
                load_on_start=load_on_start,
            )
        )
        url = f"http://127.0.0.1:{port}/"
        start = time.perf_counter()
        proc, log_path = self._popen([sys.executable, "app.py"], f"startup-{label}", env=env, stdout=subprocess.DEVNULL)
        peak = 0.0
        try:
            handle = psutil.Process(proc.pid)
            deadline = time.monotonic() + self.cfg.timeout_s

            def sample() -> None:
                nonlocal peak
                with contextlib.suppress(psutil.Error):
                    peak = max(peak, handle.memory_info().rss / 2**20)
                if proc.poll() is not None:
                    raise BenchError(f"app.py ({label}) exited with {proc.returncode}: {log_tail(log_path)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"app.py ({label}) timed out")

            while not http_ok(url):
                sample()
                time.sleep(0.02)
            page_s = time.perf_counter() - start
            # The first request arrives as soon as the page answers: it is what loads a lazy server.
            first: dict[str, Any] = {}
            requester = threading.Thread(target=self._first_request, args=(url, first, start), daemon=True)
            requester.start()
            status: dict[str, Any] = {}
            while not status.get("loaded"):
                sample()
                status = _status_http(url)
                if status.get("load_error"):
                    raise BenchError(f"app.py ({label}): {status['load_error']}")
                time.sleep(0.02)
            loaded_s = time.perf_counter() - start
            while requester.is_alive():
                sample()
                requester.join(timeout=0.1)
            if "error" in first:
                raise BenchError(f"app.py ({label}) first request: {first['error']}")
            sample()
        finally:
            stop_group(proc)
        self.log(f"startup {label}: page {page_s:.2f} s, loaded {loaded_s:.2f} s, image {first['first_image_s']:.2f} s")
        return {
            "start": label,
            "page_s": page_s,
            "loaded_s": loaded_s,
            "first_image_s": first["first_image_s"],
            "load_s": status.get("load_s"),
            "first_cache": first.get("cache"),
            "peak_rss_mb": peak,
        }

    def _first_request(self, url: str, into: dict[str, Any], start: float) -> None:
        try:
            _path, info = self.client(url).predict(PROMPT, self.cfg.shapes[0], self.cfg.steps, 0, api_name="/generate")
            into["first_image_s"] = time.perf_counter() - start
            into["cache"] = info.get("cache")
        except Exception as exc:
            into["error"] = f"{type(exc).__name__}: {exc}"

    # --- the run --------------------------------------------------------------------------------
    def section(self, name: str, fn: Any) -> None:
        self.log(f"section {name} ...")
        start = time.perf_counter()
        try:
            data = fn()
            self.results[name] = {**data, "status": "ok", "section_s": time.perf_counter() - start}
        except Exception as exc:
            self.log(f"section {name} FAILED: {exc}")
            self.results[name] = {"status": "error", "error": str(exc), "section_s": time.perf_counter() - start}

    def serving_and_concurrency(self) -> None:
        wanted = [s for s in ("serving", "concurrency") if s in self.cfg.sections]
        self.log(f"section {' + '.join(wanted)} ...")
        start = time.perf_counter()
        try:
            with self.server() as server:
                if "serving" in wanted:
                    self.section("serving", lambda: self.measure_serving(server))
                if "concurrency" in wanted:
                    self.section("concurrency", lambda: self.measure_concurrency(server))
            if "serving" in self.results and "final" in server:
                self.results["serving"]["server"] = server["final"]
        except Exception as exc:
            self.log(f"server FAILED: {exc}")
            for name in wanted:
                self.results.setdefault(name, {"status": "error", "error": str(exc)})
        self.log(f"serving done in {time.perf_counter() - start:.1f} s")

    def run(self) -> dict[str, Any]:
        started = datetime.now(UTC)
        wall = time.perf_counter()
        others = ShareOfOthers()
        sections = self.cfg.sections
        machine = machine_info()
        self.log(
            f"machine: {machine['cores_logical']} cores ({machine['cpu']}), torch {machine['versions']['torch']}, "
            f"device {self.cfg.device}, load average {machine['load_avg_start'][0]}"
        )
        tasks: dict[str, Callable[[], None]] = {}
        if "modes" in sections or "memory" in sections:
            tasks["modes"] = lambda: self.section("modes", self.section_modes)
        if "restart" in sections:
            tasks["restart"] = lambda: self.section("restart", self.section_restart)
        if "recompile" in sections:
            tasks["recompile"] = lambda: self.section("recompile", self.section_recompile)
        if "serving" in sections or "concurrency" in sections:
            tasks["serving"] = self.serving_and_concurrency
        if "startup" in sections:
            tasks["startup"] = lambda: self.section("startup", self.section_startup)
        if "lora" in sections:
            tasks["lora"] = lambda: self.section("lora", lambda: lora.section(self))
        if "replicas" in sections:
            from neuron_app.bench.sections.replicas import section_replicas

            tasks["replicas"] = lambda: self.section("replicas", lambda: section_replicas(self))
        if "families" in sections:
            tasks["families"] = lambda: self.section("families", self.section_families)
        if "edit" in sections:
            tasks["edit"] = lambda: self.section("edit", self.section_edit)
        # With --jobs > 1 (the smoke run) independent processes run side by side, each in a fresh folder
        # but the warm restart, which needs the cold run's folder. Timings are then not comparable.
        parallel_phases = [
            ["modes", "recompile", "startup", "serving", "families", "edit"],
            ["restart", "lora", "replicas"],
        ]
        phases = parallel_phases if self.parallel else [[t] for t in tasks]
        try:
            self.prepare()
            for phase in phases:
                group = [tasks[name] for name in phase if name in tasks]
                with ThreadPoolExecutor(max_workers=max(1, len(group))) as pool:
                    for future in [pool.submit(task) for task in group]:
                        future.result()
            if "memory" in sections:
                self.section("memory", self.section_memory)
        finally:
            if not self.cfg.keep_work:
                shutil.rmtree(self.work, ignore_errors=True)
        machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
        machine["others_cpu_share"] = round(others.share(), 3)
        device = self.resolved.get("device") or self.cfg.device
        return {
            "schema": SCHEMA_VERSION,
            "command": self.cfg.command,
            "started_at": started.isoformat(timespec="seconds"),
            "duration_s": time.perf_counter() - wall,
            "machine": machine | {"device": device},
            "config": self.cfg.public(),
            "resolved": self.resolved,
            "sections": self.results,
        }


def _process_times(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("load_s", "loaded_at_s", "first_image_at_s", "process_s", "peak_rss_mb")
    return {k: run.get(k) for k in keys}


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


__all__ = ["BenchConfig", "BenchError", "Harness", "machine_info", "settings_env"]
