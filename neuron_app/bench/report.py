"""Markdown from results JSON: the run's table and BENCHMARKS.md. Every number here comes from the JSON."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import ratio
from neuron_app.bench.sections import lora

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


def modes_md(results: dict[str, Any]) -> str:
    sec = results["sections"].get("modes")
    if (why := md.failed(sec)) is not None:
        return why
    rows = []
    for mode, run in sec["runs"].items():
        for shape, s in run["shapes"].items():
            rows.append(
                [
                    shape,
                    mode,
                    run["backend"] if mode != "eager" else "-",
                    s["graphs"],
                    md.s(s["compile_s"]),
                    md.s(s["first_image_s"]),
                    md.ms(s["steady"]["median_s"]),
                    md.ms(s["steady"]["p95_s"]),
                    s["steady"]["n"],
                    s["steady_graphs"],
                ]
            )
    text = (
        "Each mode in its own process with an empty cache folder. Cold compile = `compile_shape` (a one-step "
        "warm-up at that shape); the first shape of a process also pays the compiler's one-time start-up. "
        "Latency = `generate()` wall time after the first image.\n\n"
    )
    text += md.table(
        [
            "shape",
            "mode",
            "backend",
            "graphs",
            "cold compile s",
            "first image s",
            "latency median ms",
            "latency p95 ms",
            "n",
            "recompiles after",
        ],
        rows,
    )
    if sec["ratios"]:
        ratio_rows = [
            [shape, md.x(r["compile_regional_over_full"]), md.x(r["latency_regional_over_full"])]
            for shape, r in sec["ratios"].items()
        ]
        text += "\n\n" + md.table(["shape", "compile regional/full", "latency regional/full"], ratio_rows)
    return text


def restart_md(results: dict[str, Any]) -> str:
    sec = results["sections"].get("restart")
    if (why := md.failed(sec)) is not None:
        return why
    rows = [
        [
            r["shape"],
            f"{md.s(r['cold_first_image_s'])} ({r['cold_cache']})",
            f"{md.s(r['warm_first_image_s'])} ({r['warm_cache']})",
            md.x(r["warm_over_cold"]),
        ]
        for r in sec["rows"]
    ]
    cold, warm = sec["cold"], sec["warm"]
    rows.append(
        [
            "process start to first image",
            md.s(cold["first_image_at_s"]),
            md.s(warm["first_image_at_s"]),
            md.x(ratio(warm["first_image_at_s"], cold["first_image_at_s"])),
        ]
    )
    return (
        f"Mode {sec['mode']}; cold run: `{sec['cold_run']}` (empty cache folder); warm run: a new process on the "
        "same folder. First image = compile + first generation, seconds (the manager's cache result).\n\n"
        + md.table(["shape", "cold s (cache)", "warm s (cache)", "warm/cold"], rows)
    )


def recompile_md(results: dict[str, Any]) -> str:
    sec = results["sections"].get("recompile")
    if (why := md.failed(sec)) is not None:
        return why
    rows = [
        [i + 1, c["call"], c["shape"], c["steps"], c["seed"], c["prompt"], c["graphs_counted"], c["cache"]]
        for i, c in enumerate(sec["calls"])
    ]
    verdict = "OK" if sec["ok"] else "**WRONG**"
    return (
        md.table(["#", "call", "shape", "steps", "seed", "prompt", "graphs compiled", "cache"], rows)
        + f"\n\nMode {sec['mode']} / {sec['backend']}, cache folder {sec['cache_folder']}: "
        f"**{sec['compile_events']} compile(s) for {sec['distinct_graph_keys']} distinct graph shape(s)** "
        f"({sec['graphs_total']} graph(s) in all, {sec['compile_failures']} failure(s)): {verdict}."
    )


def serving_md(results: dict[str, Any]) -> str:
    sec = results["sections"].get("serving")
    if (why := md.failed(sec)) is not None:
        return why
    d, a, st = sec["direct"], sec["via_app"], sec["status_rtt"]
    rows = [
        ["manager.generate() in the server process", md.ms(d["median_s"]), md.ms(d["p95_s"]), d["n"]],
        ["gradio_client `/generate` (another process)", md.ms(a["median_s"]), md.ms(a["p95_s"]), a["n"]],
        [
            "**difference (serving overhead)**",
            md.num(sec["overhead_median_ms"], 1),
            md.num(sec["overhead_p95_ms"], 1),
            "",
        ],
        ["gradio_client `/status` round trip (no queue)", md.ms(st["median_s"]), md.ms(st["p95_s"]), st["n"]],
    ]
    if "floor_rtt" in sec:  # a queued endpoint that does nothing, interleaved with the calls above
        fl = sec["floor_rtt"]
        rows.append(
            [
                "gradio_client `/floor` round trip (queued, trivial: the floor)",
                md.ms(fl["median_s"]),
                md.ms(fl["p95_s"]),
                fl["n"],
            ]
        )
        rows.append(
            ["overhead above the trivial floor (difference - floor)", md.num(sec["overhead_above_floor_ms"], 1), "", ""]
        )
    note = ""
    if "wire" in sec:  # the same calls without gradio_client's 50 ms message poll
        w = sec["wire"]
        for label, key in (
            ("on the wire: `/generate` (image downloaded)", "generate"),
            ("on the wire: `/floor` (trivial)", "floor"),
            ("on the wire: `/floor` sleeping generate's `total_s` (matched floor)", "matched_floor"),
        ):
            rows.append([label, md.ms(w[key]["median_s"]), md.ms(w[key]["p95_s"]), w[key]["n"]])
        rows.append(
            ["**on the wire: generate above the matched floor**", md.num(sec["wire_above_matched_floor_ms"], 1), "", ""]
        )
        note = (
            "\n\ngradio_client reads its message queue every 50 ms (`stream_sse_v1plus` in `gradio_client/utils.py`), "
            "so its round trips grow in 50 ms steps with the handler's duration. The wire rows speak Gradio's queue "
            "protocol directly (`neuron_app/bench/wire.py`: join, then read the event stream as it arrives); there "
            "the matched floor is the text endpoint sleeping as long as the generate before it took in the manager, "
            "so generate minus it is what serving an image adds (the PNG save, the image output, progress events, "
            "the download)."
        )
    return (
        f"Shape {sec['shape']}, {sec['steps']} steps, mode {sec['mode']} / {sec['backend']}, "
        f"cache folder {sec['cache_folder']}.\n\n" + md.table(["path", "median ms", "p95 ms", "n"], rows) + note
    )


def concurrency_md(results: dict[str, Any]) -> str:
    sec = results["sections"].get("concurrency")
    if (why := md.failed(sec)) is not None:
        return why
    rows = [
        [
            r["clients"],
            r["sent"],
            r["ok"],
            r["errors"],
            r["lost"],
            md.s(r["wall_s"]),
            md.num(r["images_per_s"], 2),
            md.ms(r["latency"]["median_s"]),
            md.ms(r["latency"]["p95_s"]),
        ]
        for r in sec["rows"]
    ]
    return (
        f"Shape {sec['shape']}, {sec['per_client']} request(s) per client, each client its own "
        "`gradio_client.Client` in its own thread; the server runs one generation at a time.\n\n"
        + md.table(["clients", "sent", "ok", "errors", "lost", "wall s", "images/s", "median ms", "p95 ms"], rows)
    )


def memory_md(results: dict[str, Any]) -> str:
    sec = results["sections"].get("memory")
    if (why := md.failed(sec)) is not None:
        return why
    rows = [[r["process"], r["mode"], md.num(r["peak_rss_mb"], 0)] for r in sec["rows"]]
    return md.table(["process", "mode", "peak RSS MB"], rows)


def startup_md(results: dict[str, Any]) -> str:
    sec = results["sections"].get("startup")
    if (why := md.failed(sec)) is not None:
        return why
    rows = [
        [
            r["start"],
            md.s(r["page_s"]),
            md.s(r["loaded_s"]),
            md.s(r["load_s"]),
            md.s(r["first_image_s"]),
            r["first_cache"],
        ]
        for r in sec["rows"]
    ]
    floor = ""
    if "trivial_page_s" in sec:  # a one-textbox Gradio app started in the same run
        floor = (
            f"\n\nA trivial Gradio app (one textbox) answered {md.s(sec['trivial_page_s'])} s after its start; "
            f"our lazy page took {md.x(sec['page_vs_trivial'])} that."
        )
    return (
        f"`python app.py`, mode {sec['mode']}, cache folder {sec['cache_folder']}; seconds from the process start. "
        f"The first request ({sec['shape']}) is sent as soon as the page answers (it is what loads a lazy server).\n\n"
        + md.table(["start", "page HTTP 200 s", "model loaded s", "load itself s", "first image s", "cache"], rows)
        + floor
    )


def _replicas_md(results: dict[str, Any]) -> str:
    from neuron_app.bench.sections.replicas import replicas_md

    return replicas_md(results)


def families_md(results: dict[str, Any]) -> str:
    sec = results["sections"].get("families")
    failed = md.failed(sec)
    if failed:
        return failed
    labels = {"whole-vae": "VAE compiled whole (one graph per latent shape)", "tiled-vae": "tiled VAE (vae_compile on)"}
    rows = []
    for path, run in sec["paths"].items():
        miss, hit = run["generate_miss"]["median_s"], run["generate_hit"]["median_s"]
        rows.append(
            [
                labels.get(path, path),
                run["transformer_graphs"],
                run["vae_graphs"],
                md.s(run["compile_s"]),
                md.ms(run["encode"]["median_s"]),
                md.ms(miss),
                md.ms(hit),
                md.x(ratio(hit, miss)),
            ]
        )
    verdict = "yes" if sec["ok"] else "NO"
    return (
        f"The {len(sec['shapes'])} shapes {', '.join(sec['shapes'])} ({sec['families']} token families), "
        f"mode {sec['mode']}, VAE tile {sec['tile']} latent px, overlap {sec['overlap']}; each path in a fresh "
        f"process and an empty cache folder. Tiled path compiles one transformer graph per family and one VAE "
        f"graph: {verdict}. Then, on the last shape: the text encoder alone, a generation with a new prompt "
        "(cache miss) and with a repeated one (hit: the encoder is skipped).\n\n"
        + md.table(
            [
                "path",
                "transformer graphs",
                "VAE graphs",
                "compile s (all shapes)",
                "encode ms",
                "generate, new prompt ms",
                "generate, cached prompt ms",
                "cached / new",
            ],
            rows,
        )
    )


def edit_md(results: dict[str, Any]) -> str:
    sec = results["sections"].get("edit")
    if (why := md.failed(sec)) is not None:
        return why
    rows = [
        [
            r["references"],
            r["image_tokens"],
            r["graphs"],
            md.s(r["compile_s"]),
            md.x(r["compile_over_0"]),
            md.s(r["first_image_s"]),
            md.ms(r["steady"]["median_s"]),
            md.ms(r["steady"]["p95_s"]),
            md.x(r["latency_over_0"]),
            r["steady"]["n"],
            r["steady_graphs"],
        ]
        for r in sec["rows"]
    ]
    warm = f" after the compiler's start-up was paid on {sec['warm_shape']}" if sec.get("warm_shape") else ""
    return (
        f"Output {sec['shape']}, {sec['steps']} steps, mode {sec['mode']} / {sec['backend']}, one process with an "
        f"empty cache folder{warm}. References are of the output's size (one bucket each), so each adds the "
        "output's image tokens to the transformer's sequence. Compile = the first call's compile; latency = "
        "`generate(..., references=...)` after it (reference preparation and VAE encoding included).\n\n"
        + md.table(
            [
                "references",
                "image tokens",
                "graphs",
                "compile s",
                "compile vs 0",
                "first image s",
                "latency median ms",
                "latency p95 ms",
                "latency vs 0",
                "n",
                "recompiles after",
            ],
            rows,
        )
    )


SECTION_TITLES = {
    "modes": ("1. Eager vs full vs regional compile", modes_md),
    "restart": ("2. Cold vs warm restart", restart_md),
    "recompile": ("3. Recompile discipline", recompile_md),
    "serving": ("4. Serving overhead", serving_md),
    "concurrency": ("5. Concurrency", concurrency_md),
    "memory": ("6. Memory", memory_md),
    "startup": ("7. Start-up", startup_md),
    "lora": ("8. LoRA style switch", lora.render),
    "replicas": ("9. Replicas (Ray Serve)", _replicas_md),
    "families": ("10. Token families, the tiled VAE and the prompt cache", families_md),
    "edit": ("11. Editing with reference images", edit_md),
}


def render_run(results: dict[str, Any], heading_level: int = 2) -> str:
    """One run's tables, in section order; sections that were not selected are left out."""
    hashes = "#" * heading_level
    parts = [f"Command: `{results['command']}`", machine_line(results)]
    selected = results["config"]["sections"]
    for key, (title, render) in SECTION_TITLES.items():
        if key in selected or key in results["sections"]:
            parts.append(f"{hashes} {title}\n\n{render(results)}")
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


def data_path(benchmarks: Path, device: str) -> Path:
    return benchmarks.parent / DATA_DIR / f"{device}.json"


def write_benchmarks(benchmarks: Path) -> Path:
    """Regenerate BENCHMARKS.md from the JSON files kept beside it."""
    runs = {}
    for path in sorted((benchmarks.parent / DATA_DIR).glob("*.json")):
        runs[path.stem] = json.loads(path.read_text())
    benchmarks.write_text(render_benchmarks(runs))
    return benchmarks


def quote_command(argv: list[str]) -> str:
    return shlex.join(["python", "-m", "neuron_app.bench", *argv])
