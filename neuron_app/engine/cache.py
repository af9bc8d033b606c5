"""The persistent compile cache folder and its manifest of compiled shapes.

The compilers keep their own artifacts (NEFF files, inductor's FX-graph cache) in
sub-folders; the manifest records which shapes were compiled under which fingerprint, so
that "precompiled" is a checked fact and not a hope. Writes are atomic and under a file lock:
several processes may precompile into one folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
#: Compiler artifact folders inside the cache folder (per device backend).
ARTIFACT_DIRS = ("inductor", "neff")

Validity = Literal["precompiled", "stale", "absent"]


def fingerprint_of(fields: dict[str, Any]) -> str:
    """A short stable hash of everything that changes the compiled graph."""
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class ManifestEntry:
    resolution: str
    fingerprint: str
    fields: dict[str, Any]
    compile_s: float
    graphs: int
    cache: str
    compiled_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))


class Manifest:
    """`manifest.json` in the cache folder: resolution -> entry."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.path = cache_dir / MANIFEST_NAME
        self._lock = FileLock(str(cache_dir / (MANIFEST_NAME + ".lock")), timeout=120)
        # The status panel asks every few seconds: re-read only when the file changed.
        self._memo: tuple[tuple[int, int, int], dict[str, ManifestEntry]] | None = None

    def entries(self) -> dict[str, ManifestEntry]:
        """Read the manifest; a corrupt one is set aside with a warning and treated as empty."""
        try:
            stat = self.path.stat()
            stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if self._memo is not None and self._memo[0] == stamp:
                return dict(self._memo[1])
            raw = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
            if data.get("version") != MANIFEST_VERSION:
                raise ValueError(f"unknown manifest version {data.get('version')!r}")
            entries = {k: ManifestEntry(**v) for k, v in data["entries"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self._set_aside(exc)
            return {}
        self._memo = (stamp, entries)
        return dict(entries)

    def _set_aside(self, exc: Exception) -> None:
        with self._lock:
            if not self.path.exists():
                return
            target = self.path.with_name(f"{MANIFEST_NAME}.corrupt-{int(time.time())}")
            try:
                os.replace(self.path, target)
            except OSError:
                return
        log.warning("manifest %s was unreadable (%s); moved to %s and starting a new one", self.path, exc, target)

    def _write(self, entries: dict[str, ManifestEntry]) -> None:
        payload = {"version": MANIFEST_VERSION, "entries": {k: asdict(v) for k, v in sorted(entries.items())}}
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=self.cache_dir)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(payload, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def record(self, entry: ManifestEntry) -> None:
        """Add or replace one shape's entry (read-merge-write under the lock)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = self.entries()
            entries[entry.resolution] = entry
            self._write(entries)

    def remove(self, resolutions: list[str]) -> int:
        with self._lock:
            entries = self.entries()
            removed = [r for r in resolutions if entries.pop(r, None) is not None]
            if removed:
                self._write(entries)
        return len(removed)

    def validity(self, resolution: str, fingerprint: str, entries: dict[str, ManifestEntry]) -> Validity:
        entry = entries.get(resolution)
        if entry is None:
            return "absent"
        return "precompiled" if entry.fingerprint == fingerprint else "stale"


def _tokens(resolution: str) -> int | None:
    width, _, height = resolution.partition("x")
    try:
        return (int(width) // 16) * (int(height) // 16)
    except ValueError:
        return None


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


def _measured(entries: dict[str, ManifestEntry], fingerprint: str, cache: str) -> list[tuple[int, ManifestEntry]]:
    """Entries under `fingerprint` whose time was a `cache` kind ("miss": a compile, "disk": a load), by tokens."""
    rows = [(_tokens(e.resolution), e) for e in entries.values() if e.fingerprint == fingerprint and e.cache == cache]
    return [(t, e) for t, e in rows if t]


def _scaled(rows: list[tuple[int, ManifestEntry]], tokens: int) -> tuple[float, str]:
    """Seconds at `tokens` from measured shapes: between the nearest below and above (linear in tokens),
    or the nearest one scaled by the token ratio (clamped to 0.5x..2x: compile time grows slower than tokens)."""
    below = max((r for r in rows if r[0] <= tokens), key=lambda r: r[0], default=None)
    above = min((r for r in rows if r[0] >= tokens), key=lambda r: r[0], default=None)
    if below and above and below[0] != above[0]:
        share = (tokens - below[0]) / (above[0] - below[0])
        seconds = below[1].compile_s + share * (above[1].compile_s - below[1].compile_s)
        return seconds, f"interpolated between {below[1].resolution} and {above[1].resolution}"
    nearest_tokens, nearest = below or above or min(rows, key=lambda r: abs(r[0] - tokens))
    if nearest_tokens == tokens:
        return nearest.compile_s, f"as {nearest.resolution} (same size)"
    return nearest.compile_s * min(2.0, max(0.5, tokens / nearest_tokens)), f"scaled from {nearest.resolution}"


def estimate(entries: dict[str, ManifestEntry], resolution: str, fingerprint: str) -> Estimate | None:
    """Predict what making `resolution` ready costs, from the manifest's history (compiles measured here count
    the moment they finish: the manager records them there).

    Precompiled under this fingerprint: a load, its own measured load ("disk") time, else loads of other shapes
    scaled by tokens, else at most its compile time. Otherwise a compile: the measured compiles from scratch
    nearest in image tokens (engine/cache.py `_scaled`); else the mean of compiles under other settings (rough).
    None when there is no history at all.
    """
    tokens = _tokens(resolution)
    own = entries.get(resolution)
    if own is not None and own.fingerprint == fingerprint:
        if own.cache == "disk":
            return Estimate(own.compile_s, "load", "its last load, measured", "measured")
        loads = _measured(entries, fingerprint, "disk")
        if tokens and loads:
            seconds, basis = _scaled(loads, tokens)
            sure = "interpolated" if basis.startswith("interpolated") else "scaled"
            return Estimate(min(seconds, own.compile_s), "load", f"loads {basis}", sure)
        return Estimate(own.compile_s, "load", "at most its compile time; no load measured yet", "upper bound")
    rows = _measured(entries, fingerprint, "miss")
    if tokens and rows:
        seconds, basis = _scaled(rows, tokens)
        return Estimate(seconds, "compile", basis, "interpolated" if basis.startswith("interpolated") else "scaled")
    others = [e.compile_s for e in entries.values() if e.cache == "miss"] or [e.compile_s for e in entries.values()]
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


def estimate_words(seconds: float | None) -> str:
    """How a compile estimate reads everywhere (labels, status rows, progress lines); says so when there is none."""
    return "no history for an estimate" if seconds is None else f"about {human_seconds(seconds)}"


def folder_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def clear_artifacts(cache_dir: Path) -> list[Path]:
    """Remove the compilers' artifact folders and the manifest, and nothing outside `cache_dir`."""
    root = cache_dir.resolve()
    removed = []
    for name in (*ARTIFACT_DIRS, MANIFEST_NAME):
        target = (root / name).resolve()
        if target.parent != root or not target.exists() or target.is_symlink():
            continue  # never follow a link out of the cache folder
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
        removed.append(target)
    return removed


class FolderSize:
    """The cache folder's size for status, re-measured at most every `ttl_s` (walking a big NEFF cache costs)."""

    def __init__(self, folder: Path, ttl_s: float = 10.0) -> None:
        self.folder, self.ttl_s = folder, ttl_s
        self._stamp, self._size = 0.0, 0

    def invalidate(self) -> None:
        self._stamp = 0.0

    def get(self) -> int:
        now = time.monotonic()
        if self._stamp == 0.0 or now - self._stamp > self.ttl_s:
            self._size = folder_size(self.folder) if self.folder.exists() else 0
            self._stamp = now
        return self._size
