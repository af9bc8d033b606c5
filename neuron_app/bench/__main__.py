"""`python -m neuron_app.bench`: run the benchmark; `... render` rebuilds BENCHMARKS.md from its JSON.

`... _worker '<json>'` is internal: one measurement in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from neuron_app.bench import SECTIONS

#: The run's sized options: (name, the full run's default, the smoke run's default, type, help). The full run is
#: sized for a 2-core CPU in about five minutes; the smoke run is the smallest end-to-end run (what the test suite
#: runs): tiny model, aot_eager compiles in seconds.
OPTIONS: list[tuple[str, Any, Any, type, str]] = [
    ("model", "tiny-deep", "tiny", str, "tiny, tiny-deep, or a Hub id / pipeline folder"),
    ("device", "auto", "cpu", str, "auto, neuron, cuda or cpu"),
    ("shapes", "64x64,128x128", "64x64", str, "WIDTHxHEIGHT list, comma separated"),
    ("recompile_shapes", None, "64x64,128x128", str, "shapes A,B of the recompile sequence (none: the first two)"),
    ("steps", 4, 1, int, "denoising steps per image"),
    ("modes", "eager,full,regional", "eager,full,regional", str, "compile modes to compare: eager,full,regional"),
    ("backend", None, "aot_eager", str, "torch.compile backend (none: the device's, inductor on CPU)"),
    ("repeats", 10, 2, int, "timed calls per measurement"),
    ("clients", "1,4,8", "1,2", str, "concurrent client counts, comma separated"),
    ("per_client", 3, 1, int, "requests per concurrent client"),
    ("jobs", 1, 4, int, "processes run side by side (more than 1: timings are not comparable)"),
    # 384x384: where compute outweighs the per-request cost, as on a device
    ("replicas_shape", "384x384", None, str, "ready shape of the replicas' throughput and freeze (none: the first)"),
]
DEVICES = ("auto", "neuron", "cuda", "cpu")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m neuron_app.bench",
        description="Measure compile cost, cache wins, recompile discipline, serving overhead, concurrency, "
        "memory and start-up, in one run. `python -m neuron_app.bench render --benchmarks BENCHMARKS.md` "
        "regenerates BENCHMARKS.md from the JSON kept in benchmarks/.",
    )
    for name, full, smoke, kind, text in OPTIONS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"{text} (default {full}; --smoke {smoke})")
    parser.add_argument("--seq-len", type=int, help="max_sequence_length (default 32 for tiny models, else 512)")
    parser.add_argument("--sections", default="all", help=f"comma separated, of: {', '.join(SECTIONS)} (default all)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for results.json, results.md, logs")
    parser.add_argument("--benchmarks", type=Path, help="also store the JSON in benchmarks/ and regenerate this file")
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op CPU threads per process (OMP_NUM_THREADS); default 1 for the tiny models, which gain "
        "nothing from more and stall badly when another process takes a core; 0 leaves torch's default",
    )
    parser.add_argument("--models-dir", type=Path, help="folder holding (or to hold) the built tiny models")
    parser.add_argument("--timeout", type=float, help="seconds per subprocess (default 900; 7200 on neuron)")
    parser.add_argument("--smoke", action="store_true", help="the smallest end-to-end run (tiny model, aot_eager)")
    parser.add_argument("--keep-work", action="store_true", help="keep the cache folders (printed at the end)")
    return parser


def config_from_args(args: argparse.Namespace, argv: list[str]) -> Any:
    from neuron_app.bench.harness import BenchConfig
    from neuron_app.bench.report import quote_command
    from neuron_app.engine.model.tiny import VARIANTS
    from neuron_app.shapes import Resolution

    defaults = {name: smoke if args.smoke else full for name, full, smoke, _kind, _text in OPTIONS}
    value = {key: default if getattr(args, key) is None else getattr(args, key) for key, default in defaults.items()}
    shapes = [str(Resolution.parse(s)) for s in _csv(value["shapes"])]
    recompile = [str(Resolution.parse(s)) for s in _csv(value["recompile_shapes"] or ",".join(shapes[:2]))]
    modes = _csv(value["modes"])
    sections = list(SECTIONS) if args.sections == "all" else _csv(args.sections)
    errors = [f"unknown mode {m!r}" for m in modes if m not in ("eager", "full", "regional")]
    errors += [f"unknown section {s!r}" for s in sections if s not in SECTIONS]
    errors += [f"unknown device {value['device']!r}"] if value["device"] not in DEVICES else []
    if not shapes or not modes:
        errors.append("give at least one shape and one mode")
    if not 1 <= len(recompile) <= 2:
        errors.append("--recompile-shapes takes one or two shapes")
    if errors:
        raise SystemExit("bench: " + "; ".join(errors))
    timeout = args.timeout or (7200.0 if value["device"] == "neuron" else 900.0)
    return BenchConfig(
        model=value["model"],
        device=value["device"],
        shapes=shapes,
        steps=int(value["steps"]),
        modes=modes,
        backend=value["backend"],
        repeats=int(value["repeats"]),
        clients=[int(c) for c in _csv(value["clients"])],
        per_client=int(value["per_client"]),
        jobs=max(1, int(value["jobs"])),
        threads=(1 if value["model"] in VARIANTS else None) if args.threads is None else (args.threads or None),
        models_dir=args.models_dir.resolve() if args.models_dir else None,
        seq_len=args.seq_len or (32 if value["model"] in VARIANTS else 512),
        sections=sections,
        recompile_shapes=recompile,
        timeout_s=timeout,
        out=args.out,
        command=quote_command(argv),
        smoke=args.smoke,
        keep_work=args.keep_work,
        replicas_shape=str(Resolution.parse(value["replicas_shape"])) if value["replicas_shape"] else None,
    )


def run(argv: list[str]) -> int:
    from neuron_app.bench.harness import Harness
    from neuron_app.bench.report import data_path, render_run, write_benchmarks

    args = build_parser().parse_args(argv)
    config = config_from_args(args, argv)
    config.out.mkdir(parents=True, exist_ok=True)
    harness = Harness(config)
    results = harness.run()
    (config.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = render_run(results)
    (config.out / "results.md").write_text(markdown)
    print(markdown)
    if args.benchmarks:
        stored = data_path(args.benchmarks, results["machine"]["device"])
        stored.parent.mkdir(parents=True, exist_ok=True)
        stored.write_text(json.dumps(results, indent=2) + "\n")
        write_benchmarks(args.benchmarks)
        harness.log(f"wrote {stored} and {args.benchmarks}")
    if config.keep_work:
        harness.log(f"work folder kept: {harness.work}")
    failed = [name for name, sec in results["sections"].items() if sec.get("status") != "ok"]
    if failed:
        harness.log(f"sections failed: {', '.join(failed)} (logs in {config.out / 'logs'})")
    return 1 if failed else 0


def render(argv: list[str]) -> int:
    from neuron_app.bench.report import render_run, write_benchmarks

    parser = argparse.ArgumentParser(prog="python -m neuron_app.bench render")
    parser.add_argument("--benchmarks", type=Path, help="regenerate this BENCHMARKS.md from benchmarks/*.json")
    parser.add_argument("--json", type=Path, help="print one results.json as Markdown")
    args = parser.parse_args(argv)
    if not args.benchmarks and not args.json:
        parser.error("give --benchmarks or --json")
    if args.json:
        print(render_run(json.loads(args.json.read_text())))
    if args.benchmarks:
        write_benchmarks(args.benchmarks)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        from neuron_app.bench.worker import main as worker_main

        return worker_main(argv[1:])
    if argv[:1] == ["render"]:
        return render(argv[1:])
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
