"""The orchestrator: runs each section's subprocesses in order and gathers one results dict.

The cache folder filled by the serving mode's cold run is reused (and said to be) by the warm restart, the
recompile sequence, the server and the start-up runs: only the measurements about a cold compile pay for one.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from neuron_app.bench.common import RESULT_TAG, BenchError, CpuMeter, free_port, settings_env
from neuron_app.bench.config import BenchConfig
from neuron_app.bench.process import Lines, log_tail, machine_info, stop_group
from neuron_app.bench.sections.compiling import edit, families, lora, modes, recompile
from neuron_app.bench.sections.serving import (
    aiperf,
    concurrency,
    memory,
    postprocess,
    replicas,
    restart,
    serving,
    startup,
)
from neuron_app.engine.model.tiny import VARIANTS
from neuron_app.settings import PROJECT_ROOT

#: Every section, in the order of the results and of BENCHMARKS.md, by its module's name. Each module has
#: `section(harness)`, `render(its results)` and `TITLE`; one with its own worker kind also `KIND` and
#: `measure(spec)`. `SECTIONS`, `worker.KINDS` and the report's sections are read from here: a new section is
#: one module, imported above and named here.
_ORDER = (modes, restart, recompile, serving, concurrency, memory, startup, lora, replicas, families, edit, postprocess)
REGISTRY: dict[str, ModuleType] = {module.__name__.rsplit(".", 1)[-1]: module for module in (*_ORDER, aiperf)}
#: Sections run only when named in --sections: they need a tool the app does not depend on (AIPerf).
OPT_IN = ("aiperf",)
#: What `--sections all` (the default) runs.
SECTIONS = tuple(name for name in REGISTRY if name not in OPT_IN)
SCHEMA_VERSION = 1
#: Sections measured on the one serving worker (`section(harness, server)`), in this order.
ON_SERVER = ("serving", "concurrency")
#: Sections that read what the others measured, run after every phase.
AFTER_ALL = ("memory",)


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
        cfg, shapes = self.cfg, self.cfg.all_shapes
        model = {"model": cfg.model, "device": cfg.device, "compile_mode": mode, "compile_backend": cfg.backend}
        run = {"resolutions": shapes, "default_resolution": shapes[0], "max_sequence_length": cfg.seq_len}
        run |= {"max_steps": max(16, cfg.steps + 1), "default_steps": cfg.steps, "cache_dir": str(cache_dir)}
        quiet = {"load_on_start": False, "warmup": "none", "only_precompiled": False, "log_level": "WARNING"}
        return model | run | quiet | extra

    def spec(
        self, kind: str, cache_dir: Path, mode: str | None = None, settings: dict[str, Any] | None = None, **fields: Any
    ) -> dict[str, Any]:
        """A worker's spec: its kind, its settings (in `mode`, the serving mode by default), the run's steps and
        repeats (unless `fields` say otherwise), and the kind's own `fields`."""
        found = {"steps": self.cfg.steps, "repeats": self.cfg.repeats} | fields
        return {
            "kind": kind,
            "settings": self.settings(mode or self.cfg.serving_mode, cache_dir, **(settings or {})),
        } | found

    def measure(
        self, name: str, kind: str, mode: str | None = None, settings: dict[str, Any] | None = None, **fields: Any
    ) -> dict[str, Any]:
        """One worker of `kind`, called `name`, on an empty cache folder of that name (see `spec`)."""
        return self.run_worker(name, self.spec(kind, self.new_cache(name), mode, settings, **fields))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
        env["GRADIO_ANALYTICS_ENABLED"] = "False"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        threads = 1 if self.parallel else self.cfg.threads  # side by side, extra threads only spin
        if threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        return env

    @contextlib.contextmanager
    def process(
        self, args: list[str], name: str, env: dict[str, str] | None = None, stop: dict | None = None, **kw: Any
    ) -> Iterator[tuple[subprocess.Popen[str], Path]]:
        """A process in its own group (stopped as a whole, by id, at the end: `stop` holds `stop_group`'s options),
        its stderr in a log named after it; what goes wrong while it runs quotes the log's tail."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{next(self._worker_ids):02d}-{name}.log"
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(
                args, cwd=PROJECT_ROOT, env=env or self.env(), stderr=log_file, text=True, start_new_session=True, **kw
            )
        try:
            yield proc, log_path
        except Exception as exc:
            raise BenchError(f"{name}: {exc}; log {log_path}: {log_tail(log_path)}") from None
        finally:
            stop_group(proc, **(stop or {}))

    def served(self) -> tuple[dict[str, Any], str]:
        """Settings for a server on a free local port (no share link), and its URL."""
        port = free_port()
        return {"server_port": port, "server_name": "127.0.0.1", "share": False}, f"http://127.0.0.1:{port}/"

    @contextlib.contextmanager
    def app(
        self, name: str, cache_dir: Path, stop: dict[str, Any] | None = None, **settings: Any
    ) -> Iterator[tuple[subprocess.Popen[str], str]]:
        """`python app.py` in the serving mode on a free port, with these settings; the process and its URL. Each
        app keeps its jobs and usage in a state folder of its own: apps sharing a cache folder (the startup
        section's two, side by side) would otherwise refuse each other at start, as two servers must."""
        served, url = self.served()
        settings.setdefault("state_dir", str(self.cfg.out / "state" / name))
        env = self.env() | settings_env(self.settings(self.cfg.serving_mode, cache_dir, **served, **settings))
        with self.process([sys.executable, "app.py"], name, env, stop, stdout=subprocess.DEVNULL) as (proc, _log):
            yield proc, url

    def worker_args(self, spec: dict[str, Any]) -> list[str]:
        return [sys.executable, "-m", "neuron_app.bench", "_worker", json.dumps(spec)]

    def run_worker(self, name: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run one measurement in a fresh process (in `env`, else the run's); its answer, or `BenchError`."""
        start = time.perf_counter()
        with self.process(self.worker_args(spec), name, env, {"exit_s": 10.0}, stdout=subprocess.PIPE) as (
            proc,
            log_path,
        ):
            result = Lines(proc.stdout).wait_for(RESULT_TAG, time.monotonic() + self.cfg.timeout_s)
        if "error" in result:
            raise BenchError(f"{name}: {result['error']} (log: {log_path})")
        self.note_resolved(result)
        self.log(f"{name}: done in {time.perf_counter() - start:.1f} s")
        return result | {"wall_s": time.perf_counter() - start}

    def note_resolved(self, result: dict[str, Any]) -> None:
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
        result = self.run_worker(name, self.spec("measure", cache_dir, mode, shapes=self.cfg.shapes))
        if mode == self.cfg.serving_mode:
            self.warm_cache = (cache_dir, name)
        return result

    def cache_for(self, name: str, fresh: bool = False) -> tuple[Path, str]:
        """The serving mode's filled cache folder if there is one (and `fresh` is not asked), else a new one."""
        if self.warm_cache is not None and not fresh:
            return self.warm_cache[0], f"reused (filled by {self.warm_cache[1]})"
        folder = self.new_cache(name)
        if not fresh:
            self.warm_cache = (folder, name)
        return folder, "empty"

    @contextlib.contextmanager
    def _downloads_in_work(self) -> Iterator[None]:
        """gradio_client stages each download in `tempfile.gettempdir()/<40 hex>/` and leaves that folder empty
        after moving the file out: about 20 a smoke run in the user's /tmp. For the run, this process's temporary
        files go in its work folder, removed at the end."""
        saved, staging = tempfile.tempdir, self.work / "tmp"
        staging.mkdir(exist_ok=True)
        tempfile.tempdir = str(staging)
        try:
            yield
        finally:
            tempfile.tempdir = saved

    def client(self, url: str) -> Any:
        from gradio_client import Client

        downloads = self.work / "downloads"
        downloads.mkdir(exist_ok=True)
        # gradio_client opens a new httpx client, with a new TLS context (the CA bundle parsed again), for every
        # HTTP call, even to an http:// URL: 8 bench clients then took more than one of this machine's two cores
        # from the server under test. On plain http there is no TLS to verify, so skip building it.
        plain = url.startswith("http://")
        return Client(
            url,
            verbose=False,
            download_files=str(downloads),
            analytics_enabled=False,
            ssl_verify=not plain,
            httpx_kwargs={"timeout": 60},  # httpx's 5 s is shorter than /info on a busy machine (stop 62)
        )

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
        wanted = [s for s in ON_SERVER if s in self.cfg.sections]
        self.log(f"section {' + '.join(wanted)} ...")
        start = time.perf_counter()
        try:
            with serving.server(self) as server:
                for name in wanted:
                    self.section(name, functools.partial(REGISTRY[name].section, self, server))
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
        others = CpuMeter()
        sections = self.cfg.sections
        machine = machine_info()
        self.log(
            f"machine: {machine['cores_logical']} cores ({machine['cpu']}), torch {machine['versions']['torch']}, "
            f"device {self.cfg.device}, load average {machine['load_avg_start'][0]}"
        )
        tasks: dict[str, Callable[[], None]] = {}
        wanted = set(sections) | ({"modes"} if "memory" in sections else set())  # memory reads the modes' runs
        for name, module in REGISTRY.items():
            if name not in wanted or name in AFTER_ALL:
                continue
            if name in ON_SERVER:  # one serving worker for both
                tasks.setdefault("serving", self.serving_and_concurrency)
            else:
                tasks[name] = functools.partial(self.section, name, functools.partial(module.section, self))
        # With --jobs > 1 (the smoke run) independent processes run side by side, each in a fresh folder
        # but the warm restart, which needs the cold run's folder. Timings are then not comparable.
        parallel_phases = [
            ["modes", "recompile", "startup", "serving", "families", "edit"],
            ["restart", "lora", "replicas", "postprocess"],
        ]
        phases = parallel_phases if self.parallel else [[t] for t in tasks]
        try:
            with self._downloads_in_work():
                self.prepare()
                for phase in phases:
                    group = [tasks[name] for name in phase if name in tasks]
                    with ThreadPoolExecutor(max_workers=max(1, len(group))) as pool:
                        for future in [pool.submit(task) for task in group]:
                            future.result()
                for name in AFTER_ALL:
                    if name in sections:
                        self.section(name, functools.partial(REGISTRY[name].section, self))
        finally:
            if not self.cfg.keep_work:
                shutil.rmtree(self.work, ignore_errors=True)
        machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
        machine["others_cpu_share"] = round(others.others_share(), 3)
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
