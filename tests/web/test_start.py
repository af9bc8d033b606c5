"""`python app.py` on a port in use: one line naming the port and the variable that moves it, exit 2, before
the imports that take seconds (torch, gradio)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT, free_port

#: Runs app.py; stops with "HEAVY <name>" (exit 3) the moment torch or gradio is first imported.
GUARD = """
import os, runpy, sys
class Guard:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "gradio", "diffusers"):
            print("HEAVY " + name, flush=True)
            os._exit(3)
        return None
sys.meta_path.insert(0, Guard())
sys.argv = [%(app)r]
runpy.run_path(%(app)r, run_name="__main__")
"""


def start_guarded(guard: str, tmp_path: Path, port: int, **env: str) -> list[str]:
    """`python app.py` (tiny, 64x64) on `port` under `guard`: it must exit 2 before any heavy import, with what it
    said on stderr, a line each."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_APP_", "OTEL_"))}
    base |= {"NEURON_APP_MODEL": "tiny", "NEURON_APP_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    base |= {"NEURON_APP_SERVER_PORT": str(port), "NEURON_APP_RESOLUTIONS": "64x64"}
    base |= {"NEURON_APP_DEFAULT_RESOLUTION": "64x64"} | env
    done = subprocess.run(
        [sys.executable, "-c", guard % {"app": str(ROOT / "app.py")}],
        cwd=tmp_path,
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "HEAVY" not in done.stdout
    return done.stderr.strip().splitlines()


def test_a_port_in_use_is_one_line_naming_the_variable_before_heavy_imports(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "quickstart.toml").write_text((ROOT / "quickstart.toml").read_text())
        lines = start_guarded(GUARD, tmp_path, port, NEURON_APP_SETTINGS="quickstart.toml")
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: port {port} on 127.0.0.1 is in use") and "NEURON_APP_SERVER_PORT" in lines[0]
    # The hint is this start with another port: the variables it was started with are kept (the quick start's
    # NEURON_APP_SETTINGS dropped would start the 4B model), the port is not the taken one.
    hint = lines[0].split("e.g. ", 1)[1]
    assert "NEURON_APP_SETTINGS=quickstart.toml" in hint and "NEURON_APP_RESOLUTIONS=64x64" in hint
    assert f"NEURON_APP_SERVER_PORT={port}" not in hint and hint.endswith("app.py")


def test_the_quick_start_names_the_port_variable() -> None:
    quick = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "NEURON_APP_SERVER_PORT" in quick


#: Runs app.py as GUARD does, with OpenTelemetry uninstalled (every `opentelemetry*` import fails as it would).
NO_OTEL = GUARD.replace(
    'if name in ("torch", "gradio", "diffusers"):',
    'if name.startswith("opentelemetry"):\n            raise ModuleNotFoundError(name)\n'
    '        if name in ("torch", "gradio", "diffusers"):',
)


def test_a_trace_endpoint_without_opentelemetry_is_one_line_before_heavy_imports(tmp_path: Path) -> None:
    """The first hour's item 12: setting OTEL_EXPORTER_OTLP_ENDPOINT without requirements-tracing.txt ended in a
    ModuleNotFoundError traceback; now one line naming what to install, exit 2, before torch or gradio."""
    with socket.socket() as probe:  # a free port: the check comes after the port's
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lines = start_guarded(NO_OTEL, tmp_path, port, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318")
    assert len(lines) == 1 and "requirements-tracing.txt" in lines[0], lines


def test_a_toml_typo_in_the_settings_file_is_one_line_naming_the_file_before_heavy_imports(tmp_path: Path) -> None:
    """The first hour (turn 6, N8): an unclosed array ended in a 51-line tomllib traceback; now one line with the
    file and TOML's own words, exit 2, as a missing file or an unknown key is."""
    (tmp_path / "x.toml").write_text('model = "tiny-shapes"\nresolutions = ["128x128"\n')
    lines = start_guarded(GUARD, tmp_path, free_port(), NEURON_APP_SETTINGS="x.toml")
    assert lines == [f"error: {tmp_path / 'x.toml'} is not valid TOML: Unclosed array (at end of document)"], lines


def test_a_mistyped_model_name_is_one_line_with_the_name_it_meant(tmp_path: Path) -> None:
    """N9: `NEURON_APP_MODEL=tiny-shape` with the quick start's file went to the Hub, and the terminal showed a
    traceback and advice to use the settings file already in use; now one line naming tiny-shapes, exit 2."""
    (tmp_path / "quickstart.toml").write_text((ROOT / "quickstart.toml").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_APP_", "OTEL_"))}
    env |= {"NEURON_APP_SETTINGS": "quickstart.toml", "NEURON_APP_MODEL": "tiny-shape"}
    env |= {"NEURON_APP_CACHE_DIR": str(tmp_path / "cache"), "NEURON_APP_SERVER_PORT": str(free_port())}
    done = subprocess.run(
        [sys.executable, str(ROOT / "app.py")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: model 'tiny-shape' is no model of this app, no folder and no Hub id (org/name): did you mean "
        "tiny-shapes?"
    ], done.stderr
