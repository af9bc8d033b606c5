"""`python -m neuron_app.bench`: run the benchmark; `... render` rebuilds BENCHMARKS.md from its JSON.

`... _worker '<json>'` is internal: one measurement in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from neuron_app.bench.config import OPTIONS, config_from_args
from neuron_app.bench.harness import OPT_IN, SECTIONS


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
    parser.add_argument(
        "--sections",
        default="all",
        help=f"comma separated, of: {', '.join(SECTIONS)} (default all); run only when named: {', '.join(OPT_IN)} "
        "(NVIDIA AIPerf against the quick-start app: pip install -r requirements-aiperf.txt)",
    )
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


def run(argv: list[str]) -> int:
    from neuron_app.bench.harness import Harness
    from neuron_app.bench.report import data_path, render_run, stored_record, write_benchmarks

    args = build_parser().parse_args(argv)
    config = config_from_args(args, argv, SECTIONS, OPT_IN)
    config.out.mkdir(parents=True, exist_ok=True)
    harness = Harness(config)
    results = harness.run()
    (config.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = render_run(results)
    (config.out / "results.md").write_text(markdown)
    print(markdown)
    if args.benchmarks:
        stored = data_path(args.benchmarks, results["machine"]["device"], config.sections)
        stored.parent.mkdir(parents=True, exist_ok=True)
        stored.write_text(json.dumps(stored_record(results), indent=2) + "\n")
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
