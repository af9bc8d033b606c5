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
from dataclasses import asdict, dataclass, field, replace
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
    #: Seconds of the last load from a cache (disk, remote); `compile_s` stays the last compile from scratch.
    load_s: float | None = None
    #: Its compile was its process's first: it carries the one-time graphs and ops (the text encoder's, the shape-free
    #: ones) that a later shape does not pay again, so it overstates a later compile (engine/cache/estimates.py).
    first_in_process: bool = False

    @property
    def compiled_here(self) -> bool:
        """`compile_s` is a measured compile from scratch (not a load recorded before any compile was seen)."""
        return self.cache == "miss"


#: Cache results that loaded a graph compiled before: their seconds are a load, not a compile.
LOADS = ("disk", "remote")


def merged(old: ManifestEntry | None, new: ManifestEntry) -> ManifestEntry:
    """A load after a restart keeps the shape's measured compile (25 s) apart from its load (4 s): overwriting
    it made the next shape's estimate a load time. Another fingerprint's entry is history of other settings."""
    same = old is not None and old.fingerprint == new.fingerprint
    if new.cache not in LOADS:
        return replace(new, load_s=old.load_s if same and old is not None else new.load_s)
    if same and old is not None:
        return replace(old, load_s=new.compile_s, graphs=max(old.graphs, new.graphs))
    return replace(new, load_s=new.compile_s)


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
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw.decode("utf-8"))  # random bytes: a UnicodeDecodeError, set aside like bad JSON
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
        # One ERROR line, as for the job store and the usage book: file names only, never the server's folder.
        log.error("manifest %s is unreadable (%s): kept aside as %s; starting a new one", self.path.name,
                  str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__, target.name)  # fmt: skip

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
        """Add or replace one shape's entry, a load beside its compile (read-merge-write under the lock)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = self.entries()
            entries[entry.resolution] = merged(entries.get(entry.resolution), entry)
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

    def verdicts(self, fields: dict[str, Any], entries: dict[str, ManifestEntry]) -> dict[str, str]:
        """Each entry for the `cache` command, against the settings in force (their fingerprint `fields`):
        `precompiled`; `stale` (this model, other settings or versions: `--clear-stale` removes it); or
        `other model: NAME` (another settings file's, e.g. the quick start's tiny-shapes: kept, never offered to
        delete, since listing without that file would otherwise wipe its cache)."""
        fingerprint, model = fingerprint_of(fields), fields.get("model")
        words = {}
        for name, entry in entries.items():
            if entry.fingerprint == fingerprint:
                words[name] = "precompiled"
            elif entry.fields.get("model") != model:
                words[name] = f"other model: {model_name(entry.fields.get('model'))}"
            else:
                words[name] = "stale"
        return words


def model_name(identity: Any) -> str:
    """A fingerprint's model as people name it: `tiny-shapes` for `tiny-shapes:<hash>`, the Hub id without its
    revision, `local` for a folder."""
    return str(identity).split("@", 1)[0].split(":", 1)[0]


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
