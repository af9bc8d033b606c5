"""Command line: `python -m neuron_app {serve,precompile,cache,doctor,verify,selftest,emulate,usage,train-tiny,plan}`.

`precompile` is what a deployment runs once before users come (or in an image build):
it fills the persistent compile cache and the manifest, so the server starts warm. It and `cache` are
commands.py's (the commands that load a manager); this module parses the arguments and runs the rest.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from neuron_app.commands import EXIT_CONFIG, EXIT_OK, cmd_cache, cmd_precompile, table


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
        steps=args.steps,
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
            print(table(list(found[0]), cells) if found else "no images recorded yet")
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
    print(table(headers, cells) if rows else "no usage recorded yet")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """What fits where and the floor per image, measured on fake tensors (neuron_app/engine/model/real/)."""
    from neuron_app.engine.model.real.plan import main_args

    return main_args(args, table)


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
    train_tiny.add_argument(
        "--steps", type=int, default=0, help="steps per stage instead of the time budget (the same run on any machine)"
    )
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
