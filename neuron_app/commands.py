"""The commands that load a manager (`python -m neuron_app precompile`, `cache`, `cache push | pull | ls-remote`),
and what every command shares: its exit codes and its table (neuron_app/__main__.py parses the arguments)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Columns padded; every cell escaped (a booked `user`'s control characters would act on the terminal)."""
    from neuron_app.errors import escape_cell

    cells = [headers, *[[("" if c is None else escape_cell(str(c))) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def command_manager(cores: str | None = None) -> Any:
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

    manager = command_manager(args.cores)
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
    print(table(["shape", "state", "cache", "graphs", "eager ops", "seconds"], rows))
    print(f"manifest: {manager.manifest.path} (fingerprint {manager.fingerprint})")
    return EXIT_FAILED if failed else EXIT_OK


def cmd_cache(args: argparse.Namespace) -> int:
    from neuron_app.engine.cache.manifest import ARTIFACT_DIRS, clear_artifacts, folder_size, model_name
    from neuron_app.settings.sources import settings_file

    if args.action:
        return cmd_cache_remote(args)
    manager = command_manager()
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
    print(table(["shape", "validity", "fingerprint", "compile s", "compiled at"], rows))
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

    manager = command_manager()
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
    print(table(["fingerprint", "shapes", "files", "bytes", "pushers", "pushed at", "model device compile"], rows))
    for item in listing:
        for line in item["problems"]:
            print(f"  {item['fingerprint']}: {line}")
    return EXIT_OK
