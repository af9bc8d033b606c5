"""What a benchmark run is configured with: the sized options (a full run, a smoke run), their checks, and the
`BenchConfig` the harness runs."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from neuron_app.engine.model.tiny import VARIANTS

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


#: Preference order for the mode that a server runs (the app's default first).
SERVING_MODES = ("full", "regional", "eager")


@dataclass
class BenchConfig:
    model: str
    device: str
    shapes: list[str]
    steps: int
    modes: list[str]
    backend: str | None
    repeats: int
    clients: list[int]
    per_client: int
    seq_len: int
    sections: list[str]
    recompile_shapes: list[str]
    timeout_s: float
    out: Path
    command: str
    jobs: int = 1
    threads: int | None = None
    models_dir: Path | None = field(default=None, repr=False)
    smoke: bool = False
    keep_work: bool = False
    replicas_shape: str | None = None

    @property
    def is_tiny(self) -> bool:
        return self.model in VARIANTS

    @property
    def serving_mode(self) -> str:
        return next(m for m in SERVING_MODES if m in self.modes)

    @property
    def all_shapes(self) -> list[str]:
        return list(dict.fromkeys(self.shapes + self.recompile_shapes))

    def public(self) -> dict[str, Any]:
        """The configuration as it goes into the results (no local paths)."""
        data = asdict(self)
        for key in ("out", "command", "keep_work", "models_dir"):
            data.pop(key)
        return data


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def config_from_args(
    args: argparse.Namespace, argv: list[str], known: tuple[str, ...], opt_in: tuple[str, ...] = ()
) -> Any:
    """The run's configuration from the command line (`known`: what `all` runs; `opt_in`: the sections run only
    when named), or `SystemExit` with one line naming what is wrong."""
    from neuron_app.shapes import Resolution

    defaults = {name: smoke if args.smoke else full for name, full, smoke, _kind, _text in OPTIONS}
    value = {key: default if getattr(args, key) is None else getattr(args, key) for key, default in defaults.items()}
    shapes = [str(Resolution.parse(s)) for s in _csv(value["shapes"])]
    recompile = [str(Resolution.parse(s)) for s in _csv(value["recompile_shapes"] or ",".join(shapes[:2]))]
    modes = _csv(value["modes"])
    sections = list(known) if args.sections == "all" else _csv(args.sections)
    errors = [f"unknown mode {m!r}" for m in modes if m not in ("eager", "full", "regional")]
    errors += [f"unknown section {s!r}" for s in sections if s not in known + opt_in]
    errors += [f"unknown device {value['device']!r}"] if value["device"] not in DEVICES else []
    if not shapes or not modes:
        errors.append("give at least one shape and one mode")
    if not 1 <= len(recompile) <= 2:
        errors.append("--recompile-shapes takes one or two shapes")
    if errors:
        raise SystemExit("bench: " + "; ".join(errors))
    tiny = value["model"] in VARIANTS
    counts = {key: int(value[key]) for key in ("steps", "repeats", "per_client")}
    return BenchConfig(
        **{key: value[key] for key in ("model", "device", "backend")},
        **counts,
        shapes=shapes,
        modes=modes,
        clients=[int(c) for c in _csv(value["clients"])],
        jobs=max(1, int(value["jobs"])),
        threads=(1 if tiny else None) if args.threads is None else (args.threads or None),
        models_dir=args.models_dir.resolve() if args.models_dir else None,
        seq_len=args.seq_len or (32 if tiny else 512),
        sections=sections,
        recompile_shapes=recompile,
        timeout_s=args.timeout or (7200.0 if value["device"] == "neuron" else 900.0),
        command=shlex.join(["python", "-m", "neuron_app.bench", *argv]),
        **{key: getattr(args, key) for key in ("out", "smoke", "keep_work")},
        replicas_shape=str(Resolution.parse(value["replicas_shape"])) if value["replicas_shape"] else None,
    )
