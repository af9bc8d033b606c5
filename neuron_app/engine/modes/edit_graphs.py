"""Edit graphs by name: "64x64 + 2 refs (64x64, 128x64)" is the output shape and its reference buckets.

The label is how status, the manifest, precompile and warm-up name an edit graph; the graph itself is keyed
by `GraphKey` (what really changes the compile), so two labels may share one graph.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from neuron_app.errors import RequestError, ShapeError
from neuron_app.shapes import Resolution

_LABEL_RE = re.compile(r"(\d+x\d+) \+ (\d+) refs? \(([0-9x, ]+)\)")
#: Edit graphs named in a refusal; the rest are counted.
_LISTED = 12
#: Reference pixels of a compile-only call: any content compiles the same graph as a real upload.
_BLANK_RGB = (128, 128, 128)


def edit_label(res: Resolution, buckets: Sequence[Resolution]) -> str:
    """Canonical name of an edit graph (buckets sorted: their order does not change what is compiled)."""
    names = sorted(str(b) for b in buckets)
    return f"{res} + {len(names)} ref{'' if len(names) == 1 else 's'} ({', '.join(names)})"


def parse_label(label: str) -> tuple[Resolution, tuple[Resolution, ...]] | None:
    """The output shape and buckets of an edit label, or None for a plain shape name or anything else."""
    match = _LABEL_RE.fullmatch(label)
    if not match:
        return None
    try:
        buckets = tuple(Resolution.parse(b.strip()) for b in match.group(3).split(","))
        res = Resolution.parse(match.group(1))
    except ShapeError:
        return None
    return (res, buckets) if len(buckets) == int(match.group(2)) else None


def blank_references(buckets: Sequence[Resolution]) -> tuple[Any, ...]:
    """Gray images at the bucket sizes, for the call that compiles an edit graph (precompile, warm-up)."""
    if not buckets:
        return ()
    from PIL import Image

    return tuple(Image.new("RGB", (b.width, b.height), _BLANK_RGB) for b in buckets)


def check_edit_compiled(
    settings: Any,
    edits: Mapping[str, Any],
    res: Resolution,
    buckets: Sequence[Resolution],
    same_graph: Callable[[str], bool] | None = None,
) -> None:
    """Refuse an edit whose graph is neither compiled (nor compiling) nor precompiled, unless edits compile on
    demand (`edit_compile_on_demand`; unset = only on loopback). The number and buckets of references are the
    caller's choice, and each new combination is a cold compile (minutes on a trn2) that every request waits
    behind (red team turn 7, row 36). `edits` is the status's `edits`; `same_graph(label)` says whether that
    label's graph is this edit's (default: the same label)."""
    if not buckets or settings.edits_compile_on_demand:
        return
    label = edit_label(res, buckets)
    ready = sorted(n for n, s in edits.items() if s.state in ("ready", "compiling") or s.manifest == "precompiled")
    same = same_graph or (lambda name: name == label)
    if any(same(name) for name in ready):
        return
    named = ", ".join(ready[:_LISTED]) + (f" and {len(ready) - _LISTED} more" if len(ready) > _LISTED else "")
    raise RequestError(
        f"the edit graph {label} is not compiled on this server, and edits do not compile on demand here; "
        f"compiled or precompiled: {named or 'none'}",
        param="references",
    )
