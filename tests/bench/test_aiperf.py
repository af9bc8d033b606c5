"""The opt-in `aiperf` bench section's wiring, without AIPerf: it reads AIPerf's exports, renders its table, stays out
of `--sections all`, and keeps its run in a record of its own beside benchmarks/cpu.json. The exports in
tests/bench/data/aiperf/ are AIPerf 0.13.0's, from a run against the quick-start app (concurrency 2, 4 requests;
its `input_config` dropped and its artifact folder shortened: they named this machine's folders). The one test that
needs AIPerf itself (its CLI takes the section's flags) skips without it."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from neuron_app.bench.harness import OPT_IN, SECTIONS
from neuron_app.bench.report import data_path, stored_record, write_benchmarks
from neuron_app.bench.sections.serving import aiperf
from tests.support import ROOT

EXPORTS = Path(__file__).parent / "data" / "aiperf"


def test_the_section_reads_aiperfs_exports_and_renders_them() -> None:
    """Requests/s and latency from AIPerf's summary, queue wait from its scrape of the app's /metrics, and every
    figure of the row in the table (with the floor's ratios)."""
    summary = json.loads((EXPORTS / "profile_export_aiperf.json").read_text())
    row = aiperf.parse_export(EXPORTS)
    assert row["requests"] == 4 and row["errors_pct"] == 0.0
    assert row["requests_per_s"] == summary["request_throughput"]["avg"]
    assert row["latency_ms"]["p50"] == summary["request_latency"]["p50"]
    assert row["latency_ms"]["p99"] == summary["request_latency"]["p99"]
    server = json.loads((EXPORTS / "server_metrics_export.json").read_text())
    (series,) = server["metrics"]["neuron_app_queue_seconds"]["series"]
    assert row["queue"]["count"] == series["stats"]["count"] == 4
    assert row["queue"]["mean_ms"] == pytest.approx(1000 * series["stats"]["sum"] / 4)
    (device,) = server["metrics"]["neuron_app_device_seconds"]["series"]
    assert row["device"]["mean_ms"] == pytest.approx(1000 * device["stats"]["sum"] / device["stats"]["count"])

    stream = {"first_partial": {"median_s": 0.25}, "completed": {"median_s": 0.5}}
    section = {"shape": "128x128", "steps": 4, "model": "tiny-shapes", "aiperf_command": "aiperf profile ..."}
    section |= {"floor": {"median_s": 0.2, "n": 10}}
    extra = {"concurrency": 2, "stream": stream, "floor": {"median_s": 0.2}}
    section["rows"] = [row | extra | {"p50_over_floor": 2.0, "throughput_over_floor": 0.5}]
    table = aiperf.render(section)
    cells = f"| 2 | 4 | 0.00 | {row['requests_per_s']:.2f} | {row['latency_ms']['p50']:.2f} |"
    assert cells in table and f"{row['queue']['mean_ms']:.2f}" in table
    assert (
        f"| 250.0 | 500.0 | {row['device']['mean_ms']:.2f} | 200.0 | 2.00 | 0.50 |" in table
        and "median 200.0 ms over 10 calls" in table
    )


def test_without_a_scrape_the_queue_columns_say_so(tmp_path: Path) -> None:
    """An AIPerf run whose /metrics scrape failed (no server_metrics_export.json): the queue wait is missing, not 0."""
    shutil.copy(EXPORTS / "profile_export_aiperf.json", tmp_path)
    row = aiperf.parse_export(tmp_path)
    assert row["queue"]["mean_ms"] is None and row["queue"]["count"] == 0 and row["device"]["mean_ms"] is None


def test_aiperf_runs_only_when_named_and_keeps_its_own_record(tmp_path: Path) -> None:
    """`all` leaves the aiperf section out; named alone, its run is kept as benchmarks/aiperf.json, a standalone
    record that BENCHMARKS.md shows under its title, and the CPU run's JSON is left as it was."""
    assert "aiperf" in OPT_IN and "aiperf" not in SECTIONS
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks")
    cpu = json.loads((tmp_path / "benchmarks" / "cpu.json").read_text())
    results = copy.deepcopy(cpu)
    results["command"] = "python -m neuron_app.bench --sections aiperf"
    results["config"]["sections"] = ["aiperf"]
    results["sections"] = {"aiperf": {"status": "error", "error": "aiperf is not installed"}}
    benchmarks = tmp_path / "BENCHMARKS.md"
    stored = data_path(benchmarks, "cpu", ["aiperf"])
    assert stored == tmp_path / "benchmarks" / "aiperf.json"
    assert data_path(benchmarks, "cpu", ["serving", "aiperf"]).name == "cpu.json"
    stored.write_text(json.dumps(stored_record(results)))
    text = write_benchmarks(benchmarks).read_text()
    assert f"## {aiperf.TITLE}\n\nMeasured with `{results['command']}`" in text
    assert "**failed**: aiperf is not installed" in text
    assert json.loads((tmp_path / "benchmarks" / "cpu.json").read_text()) == cpu


def test_aiperfs_cli_takes_the_sections_flags(tmp_path: Path) -> None:
    """The installed AIPerf knows every flag the section passes, and `image-generation` (skipped without AIPerf:
    it is not a dependency of the app or its tests, see requirements-aiperf.txt)."""
    binary = aiperf.aiperf_binary()
    if binary is None:
        pytest.skip("aiperf is not installed (pip install -r requirements-aiperf.txt, or set AIPERF)")
    command = aiperf.aiperf_command(binary, "http://127.0.0.1:1/", 2, 8, "128x128", 4, tmp_path)
    shown = subprocess.run([binary, "profile", "--help"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    for flag in [part for part in command if part.startswith("--")]:
        assert flag in shown.stdout, flag
    assert "image-generation" in shown.stdout
