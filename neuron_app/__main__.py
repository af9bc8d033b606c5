"""Command line: `python -m neuron_app {serve,precompile,cache,doctor,verify,selftest,emulate,usage,train-tiny,plan}`.

`precompile` is what a deployment runs once before users come (or in an image build):
it fills the persistent compile cache and the manifest, so the server starts warm.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    """Columns padded; every cell escaped (a booked `user`'s control characters would act on the terminal)."""
    from neuron_app.errors import escape_cell

    cells = [headers, *[[("" if c is None else escape_cell(str(c))) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _manager(cores: str | None = None) -> Any:
    """This command's manager; `--cores` reaches the settings as an argument (validated with the others)."""
    from neuron_app.environment import prepare_process
    from neuron_app.settings import get_settings, load_settings
    from neuron_app.web.server import configure_logging

    settings = load_settings(visible_cores=cores) if cores else get_settings()
    configure_logging(settings)
    prepare_process(settings)  # before the manager imports torch: TorchNeuron reads it at import

    from neuron_app.engine.manager import PipelineManager

    return PipelineManager(settings)


def cmd_precompile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from neuron_app.engine import requests
    from neuron_app.engine.modes.edit_graphs import edit_label
    from neuron_app.errors import CompileFailed, NeuronRuleViolation, RequestError

    manager = _manager(args.cores)
    names = args.resolutions or [str(r) for r in manager.resolutions]
    for name in names:  # refuse unknown shapes and buckets before loading anything
        manager.configured_resolution(name)
    settings = manager.settings
    counts = sorted(set(args.references))
    if any(n < 0 or n > settings.max_references for n in counts):
        raise RequestError(
            f"--references counts must be between 0 and max_references ({settings.max_references})",
            param="references",
        )
    first = [*settings.parsed_reference_resolutions, None][0]
    bucket = requests.check_bucket(settings, args.reference_bucket or first) if any(counts) else None
    jobs = [(name, (bucket,) * n) for name in names for n in counts]
    t0 = time.perf_counter()
    manager.ensure_loaded()
    load_s = time.perf_counter() - t0
    rows, failed = [], 0
    bar = tqdm(jobs, desc="precompile", unit="graph", file=sys.stderr)
    for name, buckets in bar:
        label = edit_label(manager.configured_resolution(name), buckets) if buckets else name
        bar.set_postfix_str(label)
        try:
            outcome = manager.compile_shape(name, references=buckets)
            row = [label, "ready", str(outcome.cache), outcome.graphs, outcome.eager_compiles]
            rows.append([*row, f"{outcome.compile_s:.2f}"])
        except (CompileFailed, NeuronRuleViolation) as exc:
            failed += 1
            rows.append([label, "failed", "", 0, 0, str(exc)[:120]])
    print(f"model {manager.settings.model} loaded in {load_s:.1f}s; cache {manager.settings.cache_dir}")
    print(_table(["shape", "state", "cache", "graphs", "eager ops", "seconds"], rows))
    print(f"manifest: {manager.manifest.path} (fingerprint {manager.fingerprint})")
    return EXIT_FAILED if failed else EXIT_OK


def cmd_cache(args: argparse.Namespace) -> int:
    from neuron_app.engine.cache.manifest import ARTIFACT_DIRS, clear_artifacts, folder_size, model_name
    from neuron_app.settings.sources import settings_file

    if args.action:
        return cmd_cache_remote(args)
    manager = _manager()
    cache_dir = manager.settings.cache_dir
    if args.clear_all:
        removed = clear_artifacts(cache_dir)
        print("removed: " + (", ".join(str(p) for p in removed) or "nothing"))
        return EXIT_OK
    entries = manager.manifest.entries()
    verdicts = manager.manifest.verdicts(manager.fingerprint_fields, entries)  # another model's entries are kept
    stale = [name for name, verdict in verdicts.items() if verdict == "stale"]
    others = sorted({verdict for verdict in verdicts.values() if verdict.startswith("other model")})
    n = sum(v in others for v in verdicts.values())
    kept = f"{n} entr{'y' if n == 1 else 'ies'} of other settings kept ({', '.join(others)})"
    model = model_name(manager.fingerprint_fields["model"])
    if args.clear_stale:
        count = manager.manifest.remove(stale)
        print(f"removed {count} stale entr{'y' if count == 1 else 'ies'} of {model}: {', '.join(stale) or '-'}"
              + (f"; {kept}" if others else ""))  # fmt: skip
        return EXIT_OK
    sizes = {name: folder_size(cache_dir / name) for name in ARTIFACT_DIRS if (cache_dir / name).exists()}
    if args.json:
        payload = {
            "cache_dir": str(cache_dir),
            "fingerprint": manager.fingerprint,
            "total_bytes": folder_size(cache_dir) if cache_dir.exists() else 0,
            "artifact_bytes": sizes,
            "entries": {name: {**vars(e), "validity": verdicts[name]} for name, e in entries.items()},
            "stale": stale,
        }
        print(json.dumps(payload, indent=2))
        return EXIT_OK
    print(f"cache folder {cache_dir}: {folder_size(cache_dir) if cache_dir.exists() else 0} bytes")
    for name, size in sizes.items():
        print(f"  {name}/: {size} bytes")
    print(f"current fingerprint {manager.fingerprint} (model {model}, settings {settings_file().name})")
    rows = [[name, verdicts[name], e.fingerprint, e.compile_s, e.compiled_at] for name, e in sorted(entries.items())]
    print(_table(["shape", "validity", "fingerprint", "compile s", "compiled at"], rows))
    if others:
        print(f"{kept}: list them with their settings file (NEURON_APP_SETTINGS=...); only --clear-all removes them")
    if stale:
        print(f"{len(stale)} stale entr{'y' if len(stale) == 1 else 'ies'} of {model} (other settings or versions): "
              "`python -m neuron_app cache --clear-stale` removes them")  # fmt: skip
    return EXIT_OK


def cmd_cache_remote(args: argparse.Namespace) -> int:
    """`cache push | pull | ls-remote`: the compiled artifacts of this fingerprint through cache_remote (S3)."""
    from neuron_app.engine.remote.cache import list_remote
    from neuron_app.engine.remote.store import RemoteError, describe

    manager = _manager()
    remote = manager.remote
    if not remote.enabled:
        raise RemoteError("cache_remote is not set: NEURON_APP_CACHE_REMOTE=s3://bucket/prefix", param="cache_remote")
    try:
        if args.action == "push":
            report = remote.push()
            print(
                f"pushed {', '.join(report.shapes)} (fingerprint {manager.fingerprint}): {report.files} files, "
                f"{report.total_bytes} bytes; uploaded {report.uploaded} new objects ({report.uploaded_bytes} bytes) "
                f"in {report.seconds:.2f}s; index {report.index}"
            )
            return EXIT_OK
        if args.action == "pull":
            pulled = remote.pull()
            if pulled.error:
                raise RemoteError(pulled.error)
            print(
                f"pulled {pulled.objects} objects ({pulled.bytes} bytes), shapes {', '.join(pulled.shapes) or '-'} "
                f"from {remote.url} in {pulled.seconds:.2f}s; {len(pulled.ignored)} ignored"
            )
            for line in pulled.ignored:
                print(f"  ignored: {line}")
            return EXIT_FAILED if pulled.ignored else EXIT_OK
        listing = list_remote(remote.url, manager.settings.cache_remote_timeout_s, remote.secret)
    except RemoteError:
        raise
    except Exception as exc:  # boto3 and network errors: one line, no traceback
        raise RemoteError(f"{remote.url}: {describe(exc)}") from exc
    if args.json:
        print(json.dumps({"url": remote.url, "fingerprint": manager.fingerprint, "fingerprints": listing}, indent=2))
        return EXIT_OK
    print(f"{remote.url}: {len(listing)} fingerprint(s); this instance's is {manager.fingerprint}")
    rows = [
        [
            ("* " if item["fingerprint"] == manager.fingerprint else "  ") + item["fingerprint"],
            ", ".join(item["shapes"]) or "-",
            item["files"],
            item["bytes"],
            item["instances"],
            item["pushed_at"],
            f"{item['model']} {item['device']} {item['compile']}",
        ]
        for item in listing
    ]
    print(_table(["fingerprint", "shapes", "files", "bytes", "pushers", "pushed at", "model device compile"], rows))
    for item in listing:
        for line in item["problems"]:
            print(f"  {item['fingerprint']}: {line}")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from neuron_app.doctor import run_doctor

    return run_doctor(stack_only=args.stack, as_json=args.json)


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0: every file has this server's marks; 1: one has none; 2: one is not a readable image."""
    from neuron_app.verify import main_args

    return main_args(args)


def cmd_selftest(args: argparse.Namespace) -> int:
    from neuron_app.selftest import main as selftest

    return selftest(args.rest)


def cmd_train_tiny(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from neuron_app.training.arguments import problem_of
    from neuron_app.training.run import Plan, train

    problem = problem_of(args)
    if problem:  # one line, before torch loads (issue 45, row 50: `--out /etc/passwd` made /etc/passwd.training/)
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    plan = Plan(
        minutes=args.minutes,
        seed=args.seed,
        out=Path(args.out),
        init=Path(args.init) if args.init else None,
        scenes_per_size=args.scenes_per_size,
        batch_tokens=args.batch_tokens or Plan.batch_tokens,
        sampler_share=args.sampler_share,
        lr=args.lr,
        edit_weight=Plan.edit_weight if args.edit_weight is None else args.edit_weight,
        mismatch_share=Plan.mismatch_share if args.mismatch_share is None else args.mismatch_share,
        bf16_share=args.bf16_share,
    )
    if args.lora_share is not None:
        plan.shares["lora"] = args.lora_share
    train(plan, progress=print)
    return EXIT_OK


def cmd_usage(args: argparse.Namespace) -> int:
    """Usage per API key, interface and day, from the usage table and the job store in the cache folder (no
    server)."""
    from neuron_app.settings import get_settings
    from neuron_app.web.jobs.usage_book import MEASURES, NO_USER, today, usage_table, users_table

    since = today(time.time() - 86400 * (args.days - 1)) if args.days else None
    if args.users:  # per end user (OpenAI's `user` / `safety_identifier`), from each image's row
        found = users_table(get_settings().state_folder, since)
        if args.json:
            print(json.dumps(found, indent=2))
        else:
            quoted = [r | {"user": NO_USER if r["user"] is None else f'"{r["user"]}"'} for r in found]  # not "-"
            cells = [list(r.values()) for r in quoted]
            print(_table(list(found[0]), cells) if found else "no images recorded yet")
        return EXIT_OK
    rows = usage_table(get_settings().state_folder, since)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    headers = ["day", "key", "interface", *MEASURES, "jobs"]
    cells = []
    for r in rows:
        jobs = " ".join(f"{status} {n}" for status, n in sorted(r["jobs"].items())) or "-"
        numbers = (int(r[m]) if float(r[m]).is_integer() else round(float(r[m]), 3) for m in MEASURES)
        cells.append([r["day"], r["key_name"], r["interface"], *numbers, jobs])
    print(_table(headers, cells) if rows else "no usage recorded yet")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """What fits where and the floor per image, measured on fake tensors (neuron_app/engine/model/real/)."""
    from neuron_app.engine.model.real.plan import main_args

    return main_args(args, _table)


def cmd_topology(args: argparse.Namespace) -> int:
    """The topology the app would serve with these settings on the cores this host holds (scale/topology.py):
    scripts/launch-trn.sh exports it (NEURON_APP_TOPOLOGY) so that every torchrun rank reads the same one."""
    import json

    from neuron_app.engine.model.real.best import topology_words
    from neuron_app.scale.topology import settle
    from neuron_app.settings import get_settings

    chosen = settle(get_settings()).topology
    print(json.dumps(chosen, separators=(",", ":")) if args.json else topology_words(chosen))
    return EXIT_OK


def cmd_serve(_args: argparse.Namespace) -> int:
    import app

    app.main()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["emulate"]:  # its arguments are the script's, `-m` included: argparse would take them
        from neuron_app.backends.emulator.emulate import main as emulate

        return emulate(argv[1:])
    if argv[:1] == ["selftest"]:  # its own options (argparse's REMAINDER refuses a leading option)
        from neuron_app.selftest import main as selftest

        return selftest(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m neuron_app", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("precompile", help="compile shapes into the persistent cache and the manifest")
    pre.add_argument("--resolutions", nargs="+", metavar="WxH", help="default: every configured resolution")
    pre.add_argument(
        "--cores",
        metavar="N-M",
        help="NeuronCores to reserve (NEURON_RT_VISIBLE_CORES), e.g. 4-7 beside a server on 0-3",
    )
    pre.add_argument(
        "--references",
        nargs="+",
        type=int,
        default=[0],
        metavar="N",
        help="reference counts to compile edit graphs for (0 = text to image; default 0), e.g. --references 0 1 2",
    )
    pre.add_argument("--reference-bucket", metavar="WxH", help="bucket of those references (default: the first)")
    pre.set_defaults(func=cmd_precompile)
    cache = sub.add_parser("cache", help="list the cache folder; remove stale entries; push/pull through S3")
    cache.add_argument(
        "action",
        nargs="?",
        choices=["push", "pull", "ls-remote"],
        help="with cache_remote: push this fingerprint's artifacts, pull them, or list the fingerprints there",
    )
    group = cache.add_mutually_exclusive_group()
    group.add_argument("--clear-stale", action="store_true", help="remove manifest entries of other fingerprints")
    group.add_argument("--clear-all", action="store_true", help="remove compiled artifacts and the manifest")
    cache.add_argument("--json", action="store_true", help="machine-readable listing")
    cache.set_defaults(func=cmd_cache)
    train_tiny = sub.add_parser("train-tiny", help="train tiny-shapes (the shapes world) on this machine's CPU")
    train_tiny.add_argument("--minutes", type=float, default=20.0, help="time budget of all stages (default 20)")
    train_tiny.add_argument("--seed", type=int, default=0)
    train_tiny.add_argument("--out", default="neuron_app/models/tiny-shapes", help="folder the pipeline is saved to")
    train_tiny.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    train_tiny.add_argument("--init", help="continue from this saved tiny-shapes folder (its VAE kept; logs appended)")
    train_tiny.add_argument("--scenes-per-size", type=int, default=0, help="scenes per size (default: by the budget)")
    train_tiny.add_argument("--batch-tokens", type=int, default=0, help="image tokens per batch (default 3072)")
    train_tiny.add_argument(
        "--sampler-share", type=float, default=0.0, help="share of batches through the unrolled 4-step sampler"
    )
    train_tiny.add_argument("--lr", type=float, default=0.0, help="peak learning rate of the flow stage")
    train_tiny.add_argument(
        "--edit-weight", type=float, help="draw weight of each of the 4 edit buckets (default 0.04)"
    )
    train_tiny.add_argument(
        "--mismatch-share",
        type=float,
        help="share of low-noise examples trained with another scene's prompt, so image-to-image keeps its source "
        "(default 0.15)",
    )
    train_tiny.add_argument(
        "--bf16-share", type=float, default=0.0, help="share of batches under bfloat16 autocast, as Neuron serves"
    )
    train_tiny.add_argument("--lora-share", type=float, help="share of the budget for the outline LoRA (default 0.18)")
    train_tiny.set_defaults(func=cmd_train_tiny)
    plan = sub.add_parser("plan", help="before any compile: memory per NeuronCore, placement and floor per image")
    from neuron_app.engine.model.real.plan import add_arguments  # torch-free: the specs' names only

    add_arguments(plan)
    plan.set_defaults(func=cmd_plan)
    topo = sub.add_parser("topology", help="the copies x TP x placement x cores the app would serve on this host")
    topo.add_argument("--json", action="store_true", help="one line of JSON (NEURON_APP_TOPOLOGY's value)")
    topo.set_defaults(func=cmd_topology)
    usage = sub.add_parser(
        "usage", help="usage per day, API key and interface (page, gradio_api, mcp, openai): the usage table and jobs"
    )
    usage.add_argument("--days", type=int, default=0, metavar="N", help="the last N days only (default: all)")
    usage.add_argument("--json", action="store_true", help="machine-readable rows")
    usage.add_argument("--users", action="store_true", help="per end user (the API's user / safety_identifier)")
    usage.set_defaults(func=cmd_usage)
    serve = sub.add_parser("serve", help="start the web app (same as python app.py)")
    serve.set_defaults(func=cmd_serve)
    doctor = sub.add_parser("doctor", help="check this machine's Neuron stack; exit 0 only when serving would work")
    doctor.add_argument("--stack", action="store_true", help="software only (no device, no instance): image builds")
    doctor.add_argument("--json", action="store_true", help="machine-readable checks")
    doctor.set_defaults(func=cmd_doctor)
    verify = sub.add_parser("verify", help="which AI-content marks images carry (C2PA, IPTC, watermark)")
    verify.add_argument("files", nargs="+", metavar="FILE", help="images to check")
    verify.add_argument("--json", action="store_true", help="machine-readable report")
    verify.set_defaults(func=cmd_verify)
    selftest = sub.add_parser(
        "selftest", help="the first device check: neuron on a trn instance, neuron-emulated elsewhere", add_help=False
    )
    selftest.add_argument("rest", nargs=argparse.REMAINDER, help="selftest's own options (--help)")
    selftest.set_defaults(func=cmd_selftest)
    emulate = sub.add_parser(
        "emulate", help="run any script (or -m MODULE) on the emulated neuron device, like coverage run", add_help=False
    )
    emulate.add_argument("rest", nargs=argparse.REMAINDER, help="[-m MODULE | SCRIPT] [ARGS] (--help)")
    args = parser.parse_args(argv)
    from neuron_app.errors import AppError

    try:
        return args.func(args)
    except AppError as exc:  # refusals and start-up errors are one clear line; failures keep their traceback
        if exc.kind == "failed":
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
