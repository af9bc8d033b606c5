"""Precompiled shapes that survive restarts: manifest, precompile command, warm-up, staleness."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from neuron_app.engine.cache.manifest import Manifest
from neuron_app.engine.manager import PipelineManager
from neuron_app.engine.records import ShapeState
from neuron_app.errors import RequestError
from tests.support import ROOT, TEST_SHAPES, link_models, run_cli, tiny_env

# A restarted process serving precompiled shapes from inductor's disk cache: tests/engine/remote/test_remote_cache.py
# (its inductor case restarts on the precompiled folder before pushing it), and on neuron-emulated
# tests/backends/test_neuron_emulated.py.


def test_changing_model_or_compile_mode_makes_entries_stale(make_settings: Any) -> None:
    settings = make_settings()
    manager = PipelineManager(settings)
    manager.compile_shape("64x64")
    assert manager.status().shapes["64x64"].manifest == "precompiled"

    regional = PipelineManager(make_settings(compile_mode="regional"))
    assert regional.fingerprint != manager.fingerprint
    assert regional.status().shapes["64x64"].manifest == "stale"
    other_model = PipelineManager(make_settings(model="tiny-deep"))
    assert other_model.status().shapes["64x64"].manifest == "stale"
    longer_prompts = PipelineManager(make_settings(max_sequence_length=64))
    assert longer_prompts.status().shapes["64x64"].manifest == "stale"


def test_cache_command_lists_and_clears_stale_entries_only(make_settings: Any, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    PipelineManager(make_settings(cache_dir=cache_dir)).compile_shape("64x64")
    PipelineManager(make_settings(cache_dir=cache_dir, compile_mode="regional")).compile_shape("128x64")
    outside = tmp_path / "keep-me.txt"
    outside.write_text("not part of the cache")

    env = tiny_env(cache_dir, NEURON_APP_COMPILE_MODE="regional")
    listing = json.loads(run_cli(env, "cache", "--json").stdout)
    assert listing["entries"]["64x64"]["validity"] == "stale"
    assert listing["entries"]["128x64"]["validity"] == "precompiled"
    assert listing["stale"] == ["64x64"]

    cleared = run_cli(env, "cache", "--clear-stale")
    assert cleared.returncode == 0 and "64x64" in cleared.stdout
    assert set(Manifest(cache_dir).entries()) == {"128x64"}
    assert outside.read_text() == "not part of the cache"
    assert (cache_dir / "models").exists()


def test_the_cache_command_keeps_another_models_entries(make_settings: Any, tmp_path: Path) -> None:
    """The first hour (turn 6, N3): `cache` without the quick start's settings file called its tiny-shapes entries
    stale and `--clear-stale` removed them. Another model's entries are named and kept; only this model's entries
    of other settings are stale and removed."""
    cache_dir = tmp_path / "cache"
    PipelineManager(make_settings(cache_dir=cache_dir)).compile_shape("64x64")  # model tiny: another settings file
    PipelineManager(make_settings(cache_dir=cache_dir, model="tiny-deep", compile_mode="regional")).compile_shape(
        "128x64"
    )
    env = tiny_env(cache_dir, NEURON_APP_MODEL="tiny-deep")
    listing = run_cli(env, "cache")
    rows = {line.split()[0]: line for line in listing.stdout.splitlines() if line.startswith(("64x64", "128x64"))}
    assert "other model: tiny" in rows["64x64"] and " stale " in rows["128x64"], listing.stdout
    assert "1 entry of other settings kept (other model: tiny)" in listing.stdout
    assert "1 stale entry of tiny-deep" in listing.stdout
    cleared = run_cli(env, "cache", "--clear-stale")
    assert cleared.stdout.strip() == (
        "removed 1 stale entry of tiny-deep: 128x64; 1 entry of other settings kept (other model: tiny)"
    ), cleared.stdout
    assert set(Manifest(cache_dir).entries()) == {"64x64"}


def test_truncated_manifest_is_set_aside_and_rebuilt(make_settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    settings = make_settings()
    manager = PipelineManager(settings)
    manager.compile_shape("64x64")
    path = settings.cache_dir / "manifest.json"
    path.write_text(path.read_text()[:25])  # a half-written file

    restarted = PipelineManager(settings)
    status = restarted.status()  # does not raise
    assert status.shapes["64x64"].manifest == "absent"
    assert "unreadable" in caplog.text
    assert list(settings.cache_dir.glob("manifest.json.corrupt-*"))
    restarted.compile_shape("128x64")
    assert set(Manifest(settings.cache_dir).entries()) == {"128x64"}


@pytest.mark.slow
def test_two_processes_precompiling_into_one_folder_leave_a_valid_manifest(tmp_path: Path, shared_models: Path) -> None:
    """The file lock serializes read-merge-write: both processes' shapes end up in the manifest."""
    cache_dir = link_models(tmp_path / "cache", shared_models)
    env = tiny_env(cache_dir)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "neuron_app", "precompile", "--resolutions", *shapes],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for shapes in (["64x64", "128x128"], ["128x64"])
    ]
    for proc in procs:
        _out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    data = json.loads((cache_dir / "manifest.json").read_text())
    assert set(data["entries"]) == {"64x64", "128x128", "128x64"}


def test_precompile_refuses_unconfigured_shapes_before_loading(tmp_path: Path) -> None:
    result = run_cli(tiny_env(tmp_path / "cache"), "precompile", "--resolutions", "2048x2048")
    assert result.returncode == 2
    assert "not configured" in result.stderr
    assert not (tmp_path / "cache" / "models").exists()


def test_only_precompiled_offers_just_the_shapes_known_to_be_compiled(make_settings: Any, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    PipelineManager(make_settings(cache_dir=cache_dir)).compile_shape("128x64")
    manager = PipelineManager(make_settings(cache_dir=cache_dir, only_precompiled=True))
    # on CPU the transpose shares the compiled graph, so it is precompiled too (its own key on Neuron)
    assert manager.offered_resolutions() == ["128x64", "64x128"]
    with pytest.raises(RequestError, match="not offered"):
        manager.generate("cold", "64x64", 1, 0)
    assert not manager.loaded
    assert manager.generate("warm", "64x128", 1, 0).resolution == "64x128"


def test_warmup_all_compiles_in_background_while_status_answers(make_settings: Any) -> None:
    manager = PipelineManager(make_settings(warmup="all"))
    with manager._load_lock:  # the warm-up's load waits while the test holds it: status must answer all the same
        thread = manager.start_warmup()
        assert thread is not None
        first_status = manager.status()  # never waits for loading (a wait here would hang to the test's timeout)
        assert first_status.warmup["running"] and not manager.loaded
    ready_counts = []
    while thread.is_alive():
        status = manager.status()
        ready_counts.append(sum(s.state is ShapeState.READY for s in status.shapes.values()))
        time.sleep(0.05)
    thread.join()
    final = manager.status()
    assert all(s.state is ShapeState.READY for s in final.shapes.values())
    assert final.warmup["done"] == TEST_SHAPES and not final.warmup["running"]
    seen = sorted(set(ready_counts))
    assert ready_counts == sorted(ready_counts)  # shapes turn ready one by one, never back
    assert len(seen) >= 3, seen


@pytest.mark.slow
def test_app_with_warmup_all_answers_at_once_and_shapes_turn_ready_one_by_one(run_app_py: Any) -> None:
    """`python app.py` with warmup=all: the page and `status` answer while the shapes compile behind. Two shapes:
    the in-process test above walks all four."""
    from gradio_client import Client

    from tests.support import PATIENT_HTTP

    shapes = ["64x64", "128x64"]
    app = run_app_py(warmup="all", resolutions=shapes)
    start = time.perf_counter()
    app.wait_up()
    client = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    first = client.predict(api_name="/status")
    page_s = time.perf_counter() - start
    assert first["warmup"]["mode"] == "all"
    seen = []
    deadline = time.monotonic() + 300  # a bound on the wait (two warm-up compiles at the serving steps), not a figure
    while time.monotonic() < deadline:
        status = client.predict(api_name="/status")
        seen.append(sum(s["state"] == "ready" for s in status["shapes"].values()))
        if not status["warmup"]["running"] and status["warmup"]["done"]:
            break
        time.sleep(0.1)
    print(f"page and status answered {page_s:.1f}s after start; ready counts seen: {sorted(set(seen))}")
    assert status["warmup"]["done"] == shapes
    assert all(s["state"] == "ready" for s in status["shapes"].values())
    assert seen == sorted(seen) and seen[0] < len(shapes)  # status answered before warm-up ended


def test_a_manifest_of_random_bytes_is_one_error_line_and_kept_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 45 (every store the same way): random bytes, not UTF-8, are one ERROR line naming the files only."""
    garbage = bytes(range(128, 256)) * 64
    (tmp_path / "manifest.json").write_bytes(garbage)
    with caplog.at_level(logging.WARNING):
        assert Manifest(tmp_path).entries() == {}
    (aside,) = tmp_path.glob("manifest.json.corrupt-*")
    assert aside.read_bytes() == garbage
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and aside.name in errors[0].getMessage() and str(tmp_path) not in errors[0].getMessage()
