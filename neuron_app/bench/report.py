"""Markdown from results JSON: the run's table and BENCHMARKS.md. Every number here comes from the JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neuron_app.bench.harness import OPT_IN, REGISTRY
from neuron_app.bench.markdown import failed

#: Where BENCHMARKS.md keeps the JSON it is generated from, relative to its own folder.
DATA_DIR = "benchmarks"
TRN_MODEL = "black-forest-labs/FLUX.2-klein-4B"
TRN_COMMAND = (
    f"python -m neuron_app.bench --device neuron --model {TRN_MODEL} --shapes 1024x1024 "
    "--recompile-shapes 1024x1024,1152x896 --steps 4 --modes eager,full,regional --repeats 5 "
    "--clients 1,4,8 --benchmarks BENCHMARKS.md"
)


def machine_line(results: dict[str, Any]) -> str:
    m, cfg, resolved = results["machine"], results["config"], results.get("resolved", {})
    backend = resolved.get("compile_backend") or cfg["backend"] or "the device's default"
    dtype = resolved.get("dtype") or "auto"
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    start, end = m.get("load_avg_start", [0])[0], m.get("load_avg_end", [0])[0]
    others = m.get("others_cpu_share")
    busy = ""
    if others is not None:
        busy = f" Other processes used {100 * others:.0f}% of the machine's CPU time during the run"
        busy += ": **the machine was busy**, absolute timings are inflated." if others >= 0.15 else "."
    return (
        f"Machine: {m['cores_logical']} logical cores ({m['cpu']}), {m['memory_gb']} GB RAM, {m['platform']}, "
        f"Python {m['python']}; {versions}. Device **{m['device']}**, model `{cfg['model']}`, "
        f"{cfg['steps']} steps, max_sequence_length {cfg['seq_len']}, compile backend {backend}, dtype {dtype}, "
        f"{cfg.get('threads') or 'default'} intra-op thread(s) per process. "
        f"Load average {start} at start, {end} at the end.{busy} "
        f"Whole run: {results['duration_s']:.0f} s."
        + (
            f" **Run with --jobs {cfg['jobs']}: processes ran side by side, so the timings only show that the "
            "harness works; they are not measurements.**"
            if cfg.get("jobs", 1) > 1
            else ""
        )
    )


def render_run(results: dict[str, Any], heading_level: int = 2) -> str:
    """One run's tables, in section order; sections that were not selected are left out, a section that did not
    run or failed says so instead of its table."""
    hashes = "#" * heading_level
    parts = [f"Command: `{results['command']}`", machine_line(results)]
    selected = results["config"]["sections"]
    for key, module in REGISTRY.items():
        if key in selected or key in results["sections"]:
            sec = results["sections"].get(key)
            parts.append(f"{hashes} {module.TITLE}\n\n{failed(sec) or module.render(sec)}")
    return "\n\n".join(parts) + "\n"


def render_benchmarks(runs: dict[str, dict[str, Any]]) -> str:
    """BENCHMARKS.md: the CPU run, and the trn run or its reproduction command marked not yet measured."""
    cpu = runs.get("cpu")
    trn = runs.get("neuron")
    regenerate = "python -m neuron_app.bench render --benchmarks BENCHMARKS.md"
    measured = f"The CPU tables were measured with `{cpu['command']}` on {cpu['started_at']}. " if cpu else ""
    parts = [
        "# Benchmarks",
        f"{measured}Generated from `{DATA_DIR}/*.json` by `{regenerate}`: no number below is typed by hand. "
        "Ratios compare runs made in one invocation, on one machine.",
        "## Tiny FLUX.2-klein on CPU (the project's development machine)",
    ]
    if cpu:
        parts.append(
            "Random weights at tiny width; `tiny-deep` has the real block structure (5 double-stream + 20 "
            "single-stream blocks), so compile-time comparisons mean something. The images are noise; "
            "the mechanics are real.\n\n" + render_run(cpu, heading_level=3).rstrip()
        )
    else:
        parts.append("**Not yet measured.** Run `python -m neuron_app.bench --benchmarks BENCHMARKS.md`.")
    parts.append("## FLUX.2-klein-4B on a trn instance")
    if trn:
        parts.append(render_run(trn, heading_level=3).rstrip())
    else:
        parts.append(
            "**Not yet measured** (no Trainium hardware was available). To measure it, on a trn2 instance with "
            "the Neuron SDK (torch-neuronx) installed and access to the model, run:\n\n"
            f"```bash\n{TRN_COMMAND}\n```\n\n"
            "It writes `benchmarks/neuron.json` and regenerates this file with the table in this section. "
            "Expect each cold compile to take minutes: the whole run can take an hour."
        )
    for name, extra in sorted(runs.items()):
        if name not in ("cpu", "neuron") and "markdown" in extra:  # a standalone measurement module's JSON
            parts.append(f"## {extra['title']}")
            parts.append(f"Measured with `{extra['command']}` on {extra['started_at']}.\n\n{extra['markdown']}")
    return "\n\n".join(parts) + "\n"


def opt_in_only(sections: list[str]) -> bool:
    """Whether a run measured only sections that `all` leaves out (AIPerf): it is kept as a record of its own."""
    return bool(sections) and all(name in OPT_IN for name in sections)


def data_path(benchmarks: Path, device: str, sections: list[str] | None = None) -> Path:
    """Where a run's JSON is kept: per device, or for an opt-in section alone, under its own name (the device's
    run, with every other table, stays as it was)."""
    if sections and opt_in_only(sections):
        return benchmarks.parent / DATA_DIR / f"{'-'.join(sections)}.json"
    return benchmarks.parent / DATA_DIR / f"{device}.json"


def stored_record(results: dict[str, Any]) -> dict[str, Any]:
    """What `--benchmarks` keeps: the results as they are, or for an opt-in section alone a standalone record
    (title, command, date, Markdown) that BENCHMARKS.md shows as a section of its own."""
    selected = results["config"]["sections"]
    if not opt_in_only(selected):
        return results
    module = REGISTRY[selected[0]]
    body = [machine_line(results)]
    for name in selected:
        sec = results["sections"].get(name)
        body.append(failed(sec) or REGISTRY[name].render(sec))
    return {
        "title": module.TITLE,
        "command": results["command"],
        "started_at": results["started_at"],
        "markdown": "\n\n".join(body),
        "results": results,
    }


def write_benchmarks(benchmarks: Path) -> Path:
    """Regenerate BENCHMARKS.md from the JSON files kept beside it."""
    runs = {}
    for path in sorted((benchmarks.parent / DATA_DIR).glob("*.json")):
        runs[path.stem] = json.loads(path.read_text())
    benchmarks.write_text(render_benchmarks(runs))
    return benchmarks
