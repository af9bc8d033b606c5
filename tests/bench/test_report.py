"""BENCHMARKS.md is generated: from the JSON kept in benchmarks/, the report renders it byte for byte, a section
that failed or did not run says so, and a standalone script's `--json` record becomes its own section."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from neuron_app.bench.report import render_run, write_benchmarks
from tests.support import ROOT


def test_benchmarks_md_is_what_its_json_renders(tmp_path: Path) -> None:
    """The committed BENCHMARKS.md, rebuilt from the committed benchmarks/*.json alone, is the same file."""
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks")
    rebuilt = write_benchmarks(tmp_path / "BENCHMARKS.md").read_text()
    assert rebuilt == (ROOT / "BENCHMARKS.md").read_text()


def test_a_failed_or_missing_section_says_so_under_its_heading() -> None:
    """One section failed, one never reported: each keeps its heading, with the error or "not run" as its text."""
    results = copy.deepcopy(json.loads((ROOT / "benchmarks" / "cpu.json").read_text()))
    results["sections"]["edit"] = {"status": "error", "error": "boom"}
    del results["sections"]["lora"]
    markdown = render_run(results)
    assert "## 11. Editing with reference images\n\n**failed**: boom\n" in markdown
    assert "## 8. LoRA style switch\n\nnot run\n" in markdown
    assert "## 10. Token families, the tiled VAE and the prompt cache\n\nThe 7 shapes" in markdown


def test_a_standalone_script_writes_its_section_of_benchmarks_md(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m neuron_app.bench.studies.klein_modes --json` (its smallest run): the record carries the printed
    Markdown and the figures, and the render puts it into BENCHMARKS.md under its title."""
    from neuron_app.bench.studies import klein_modes

    record_path = tmp_path / "benchmarks" / "klein-modes.json"
    argv = ["--skip-encoder", "--preview-shapes", "64x64", "--repeats", "1", "--json", str(record_path)]
    assert klein_modes.main(argv) == 0
    record = json.loads(record_path.read_text())
    assert record["title"] == klein_modes.TITLE
    assert record["command"] == "python -m neuron_app.bench.studies.klein_modes " + " ".join(argv)
    assert record["markdown"] + "\n" == capsys.readouterr().out
    assert set(record["results"]["previews"]) == {"64x64/128ch", "64x64/4ch"}
    assert "| 64x64 | " in record["markdown"]
    text = write_benchmarks(tmp_path / "BENCHMARKS.md").read_text()
    assert f"## {klein_modes.TITLE}\n\nMeasured with `{record['command']}` on {record['started_at']}." in text
    assert record["markdown"] in text
