"""Helpers that test modules import (conftest.py keeps the fixtures): the project root, the tiny-model
settings, free ports, `python app.py` in a subprocess, and the probe that reads the environment at the
moment torch is first imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from neuron_app import environment
from neuron_app.bench.common import free_port as free_port  # one copy: tests import it from here

ROOT = Path(__file__).resolve().parent.parent

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
