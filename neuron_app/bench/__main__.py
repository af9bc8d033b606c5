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

#: The full run: sized for a 2-core CPU in about five minutes.
FULL_DEFAULTS: dict[str, Any] = {
    "model": "tiny-deep",
    "device": "auto",
    "shapes": "64x64,128x128",
    "recompile_shapes": None,  # the first two shapes
    "steps": 4,
    "modes": "eager,full,regional",
    "backend": None,
    "repeats": 10,
    "clients": "1,4,8",
    "per_client": 3,
    "jobs": 1,
    "replicas_shape": "384x384",  # where compute outweighs the per-request cost, as on a device
}
#: The smallest end-to-end run (what the test suite runs): tiny model, aot_eager compiles in seconds.
SMOKE_DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "device": "cpu",
    "shapes": "64x64",
    "recompile_shapes": "64x64,128x128",
    "steps": 1,
    "modes": "eager,full,regional",
    "backend": "aot_eager",
    "repeats": 2,
    "clients": "1,2",
    "per_client": 1,
    "jobs": 4,
    "replicas_shape": None,  # the first shape
}


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m neuron_app.bench",
        description="Measure compile cost, cache wins, recompile discipline, serving overhead, concurrency, "
        "memory and start-up, in one run. `python -m neuron_app.bench render --benchmarks BENCHMARKS.md` "
        "regenerates BENCHMARKS.md from the JSON kept in benchmarks/.",
    )
    parser.add_argument("--model", help="tiny, tiny-deep (default), or a Hub id / pipeline folder")
    parser.add_argument("--device", choices=["auto", "neuron", "cuda", "cpu"], help="default auto")
    parser.add_argument("--shapes", help="WIDTHxHEIGHT list, comma separated (default 64x64,128x128)")
    parser.add_argument("--recompile-shapes", help="shapes A,B of the recompile sequence (default: the first two)")
    parser.add_argument("--steps", type=int, help="denoising steps per image (default 4)")
    parser.add_argument("--modes", help="compile modes to compare: eager,full,regional (default all)")
    parser.add_argument("--backend", help="torch.compile backend (default: the device's, inductor on CPU)")
    parser.add_argument("--repeats", type=int, help="timed calls per measurement (default 10)")
    parser.add_argument("--clients", help="concurrent client counts, comma separated (default 1,4,8)")
    parser.add_argument("--per-client", type=int, help="requests per concurrent client (default 3)")
    parser.add_argument(
        "--replicas-shape", help="ready shape of the replicas section's throughput and freeze (default 384x384)"
    )
    parser.add_argument("--seq-len", type=int, help="max_sequence_length (default 32 for tiny models, else 512)")
    parser.add_argument("--sections", default="all", help=f"comma separated, of: {', '.join(SECTIONS)} (default all)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for results.json, results.md, logs")
    parser.add_argument("--benchmarks", type=Path, help="also store the JSON in benchmarks/ and regenerate this file")
    parser.add_argument(
        "--jobs", type=int, help="processes run side by side (default 1; --smoke 4): timings are then not comparable"
    )
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

    defaults = SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS
    given = {key: getattr(args, key) for key in defaults}
    value = {key: given[key] if given[key] is not None else default for key, default in defaults.items()}
    shapes = [str(Resolution.parse(s)) for s in _csv(value["shapes"])]
    recompile = [str(Resolution.parse(s)) for s in _csv(value["recompile_shapes"] or ",".join(shapes[:2]))]
    modes = _csv(value["modes"])
    sections = list(SECTIONS) if args.sections == "all" else _csv(args.sections)
    errors = [f"unknown mode {m!r}" for m in modes if m not in ("eager", "full", "regional")]
    errors += [f"unknown section {s!r}" for s in sections if s not in SECTIONS]
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
