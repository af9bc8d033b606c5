"""Compile-time estimates from the manifest's history: what making a shape ready should take, and how sure.

Split from the manifest (engine/cache/manifest.py) because these are predictions read by the page, the status and the
progress lines, while the manifest is the record they are made from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from neuron_app.engine.cache.manifest import ManifestEntry

_SIZE = re.compile(r"(\d+)x(\d+)")


def _tokens(resolution: str) -> int | None:
    """Image tokens of a shape ("128x128": 64), or of an edit graph's label ("128x128 + 1 ref (128x128)": the
    output's and each reference's, 128, the sequence its transformer runs): what compile time grows with."""
    if _SIZE.fullmatch(resolution) is None and " + " not in resolution:
        return None
    sizes = _SIZE.findall(resolution)
    return sum((int(w) // 16) * (int(h) // 16) for w, h in sizes) or None


@dataclass(frozen=True)
class Estimate:
    """What making a shape ready should take, and how the number was found (so the page can say how sure it is).

    `kind` is "load" for a shape precompiled under this fingerprint (its graph comes from the cache folder) and
    "compile" otherwise; `basis` says where the seconds come from, in words.
    """

    seconds: float
    kind: Literal["load", "compile"]
    basis: str
    sure: Literal["measured", "interpolated", "scaled", "rough", "upper bound"]


Row = tuple[int, float, str]  # image tokens, seconds, the shape measured


def _compiles(entries: dict[str, ManifestEntry], fingerprint: str, warm: bool | None = None) -> list[Row]:
    """Measured compiles from scratch under `fingerprint`, by tokens. `warm` (this process has compiled before):
    its next compile is compared with compiles that were not their process's first where there are any, the
    first compile of a process with first ones (they carry one-time graphs: measured 27 s against 15 s for the
    next, tiny, aot_eager); None: all of them."""
    mine = [e for e in entries.values() if e.fingerprint == fingerprint and e.compiled_here]
    if warm is not None:
        mine = [e for e in mine if e.first_in_process != warm] or mine
    rows = [(_tokens(e.resolution), e.compile_s, e.resolution) for e in mine]
    return [(t, s, r) for t, s, r in rows if t]


def _loads(entries: dict[str, ManifestEntry], fingerprint: str) -> list[Row]:
    """Measured loads (disk, remote) under `fingerprint`, by tokens."""
    rows = [(_tokens(e.resolution), _load_s(e), e.resolution) for e in entries.values() if e.fingerprint == fingerprint]
    return [(t, s, r) for t, s, r in rows if t and s is not None]


def _load_s(entry: ManifestEntry) -> float | None:
    """Its measured load: `load_s`, or (a manifest written before `load_s`) a load recorded as its only time."""
    return entry.load_s if entry.load_s is not None else (None if entry.compiled_here else entry.compile_s)


def _scaled(rows: list[Row], tokens: int) -> tuple[float, str]:
    """Seconds at `tokens` from measured shapes: between the nearest below and above (linear in tokens),
    or the nearest one scaled by the token ratio (clamped to 0.5x..2x: compile time grows slower than tokens)."""
    below = max((r for r in rows if r[0] <= tokens), key=lambda r: r[0], default=None)
    above = min((r for r in rows if r[0] >= tokens), key=lambda r: r[0], default=None)
    if below and above and below[0] != above[0]:
        share = (tokens - below[0]) / (above[0] - below[0])
        seconds = below[1] + share * (above[1] - below[1])
        return seconds, f"interpolated between {below[2]} and {above[2]}"
    nearest_tokens, seconds, nearest = below or above or min(rows, key=lambda r: abs(r[0] - tokens))
    if nearest_tokens == tokens:
        return seconds, f"as {nearest} (same size)"
    return seconds * min(2.0, max(0.5, tokens / nearest_tokens)), f"scaled from {nearest}"


def estimate(
    entries: dict[str, ManifestEntry], resolution: str, fingerprint: str, warm: bool | None = None
) -> Estimate | None:
    """Predict what making `resolution` ready costs, from the manifest's history (compiles measured here count
    the moment they finish: the manager records them there).

    Precompiled under this fingerprint: a load, its own measured load, else loads of other shapes scaled by
    tokens, else at most its compile time. Otherwise a compile, from compiles only (a load says nothing of a
    compile's minutes): those measured under this fingerprint nearest in image tokens (`_scaled`); else the mean
    of compiles under other settings (rough: only when the fingerprint differs). None without such history.
    """
    tokens = _tokens(resolution)
    own = entries.get(resolution)
    if own is not None and own.fingerprint == fingerprint:
        if (own_load := _load_s(own)) is not None:
            return Estimate(own_load, "load", "its last load, measured", "measured")
        loads = _loads(entries, fingerprint)
        if tokens and loads:
            seconds, basis = _scaled(loads, tokens)
            sure = "interpolated" if basis.startswith("interpolated") else "scaled"
            return Estimate(min(seconds, own.compile_s), "load", f"loads {basis}", sure)
        return Estimate(own.compile_s, "load", "at most its compile time; no load measured yet", "upper bound")
    rows = _compiles(entries, fingerprint, warm)
    if tokens and rows:
        seconds, basis = _scaled(rows, tokens)
        if warm and all(entries[r].first_in_process for _t, _s, r in rows):  # one-time graphs in the number
            return Estimate(seconds, "compile", f"{basis}, its process's first compile", "upper bound")
        return Estimate(seconds, "compile", basis, "interpolated" if basis.startswith("interpolated") else "scaled")
    others = [e.compile_s for e in entries.values() if e.compiled_here and e.fingerprint != fingerprint]
    if not others:
        return None
    return Estimate(
        sum(others) / len(others), "compile", f"mean of {len(others)} compile(s) under other settings", "rough"
    )


def estimate_compile_s(entries: dict[str, ManifestEntry], resolution: str, fingerprint: str) -> float | None:
    """`estimate`'s seconds (None without history)."""
    found = estimate(entries, resolution, fingerprint)
    return None if found is None else found.seconds


def human_seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def elapsed_words(seconds: float) -> str:
    """A running time that moves on every second ("2 min 05 s"), where `human_seconds`' minutes stood still for a
    minute at a time and a compile looked frozen (turn 7's T7-3)."""
    whole = int(seconds)
    return f"{whole} s" if whole < 60 else f"{whole // 60} min {whole % 60:02d} s"


def estimate_words(seconds: float | None) -> str:
    """How a compile estimate reads everywhere (labels, status rows, progress lines); says so when there is none."""
    return "no history for an estimate" if seconds is None else f"about {human_seconds(seconds)}"
