"""What every standalone `python -m neuron_app.bench.X` shares: its command line, the tiny model's settings and the
section record that `python -m neuron_app.bench render` puts into BENCHMARKS.md."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The offline tiny model on the CPU, compiled with aot_eager (seconds): what a script runs unless it says otherwise.
TINY: dict[str, Any] = {"model": "tiny", "device": "cpu", "compile_backend": "aot_eager"}


def parser(module: str, doc: str, json_help: str | None = None, json_default: Path | None = None) -> Any:
    """The script's parser, described by its docstring; `--json PATH` where it writes a BENCHMARKS.md section."""
    found = argparse.ArgumentParser(
        prog=f"python -m neuron_app.bench.{module}", description=doc, formatter_class=argparse.RawTextHelpFormatter
    )
    if json_help:
        found.add_argument("--json", type=Path, default=json_default, help=json_help)
    return found


def main(
    module: str,
    title: str,
    found: argparse.ArgumentParser,
    measure: Callable[[argparse.Namespace], Any],
    render: Callable[[Any, str], str],
    argv: list[str] | None,
) -> int:
    """Measure, print the Markdown; with `--json` also write it, with the figures, as a section of BENCHMARKS.md."""
    args = found.parse_args(argv)
    command = " ".join([f"python -m neuron_app.bench.{module}", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    results = measure(args)
    markdown = render(results, command)
    print(markdown)
    if args.json:
        record = {"title": title, "command": command, "started_at": started, "markdown": markdown, "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def tiny_settings(resolutions: list[str], cache_dir: Path | None = None, **extra: Any) -> Any:
    """`TINY` at these shapes (the first is the default) in `cache_dir`, or in a fresh temporary folder: its first
    use compiles."""
    from neuron_app.settings import load_settings

    folder = cache_dir or Path(tempfile.mkdtemp(prefix="neuron-app-bench-"))
    fields = {"resolutions": resolutions, "default_resolution": resolutions[0], "cache_dir": folder}
    return load_settings(**(TINY | fields | extra))


def tiny_manager(resolutions: list[str], cache_dir: Path | None = None, **extra: Any) -> Any:
    """A loaded `PipelineManager` on `tiny_settings`."""
    from neuron_app.bench.common import loaded_manager

    return loaded_manager(tiny_settings(resolutions, cache_dir, **extra))
