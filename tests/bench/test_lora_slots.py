"""`python -m neuron_app.bench.sections.compiling.lora`, the LoRA slots run, on the tiny model: one row per
slot count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import link_models


def test_lora_slots_measures_each_slot_count_with_no_recompile(
    tmp_path: Path, shared_models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from neuron_app.bench.sections.compiling import lora

    out, cache_dir = tmp_path / "slots.json", link_models(tmp_path / "cache", shared_models)
    argv = ["--repeats", "1", "--max-slots", "2", "--json", str(out), "--cache-dir", str(cache_dir)]
    assert lora.main(argv) == 0
    runs = json.loads(out.read_text())["results"]
    assert [run["slots"] for run in runs] == [0, 1, 2]
    assert all(run["graphs_after_compile"] == 0 for run in runs)
    assert runs[0]["switch"] is None and all(run["switch"]["median_s"] > 0 for run in runs[1:])
    printed = capsys.readouterr().out
    assert "| 2 |" in printed and "No graph compiled after each first compile." in printed
