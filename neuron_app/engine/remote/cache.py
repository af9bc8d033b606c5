"""Compiled artifacts through S3: push once after precompiling, every instance pulls for its fingerprint.

What travels: the manifest entries of the current fingerprint and every file under the compiler's artifact
folders (the backend's `compiled_artifacts_dirs` plus the cache folder's `ARTIFACT_DIRS`: NEFFs, the inductor
cache, the eager-op record). Nothing is trusted blindly: an index part for another fingerprint, a path outside
the artifact folders, a file of a kind its folder does not hold (a .py under a NEFF folder), a part without this
server's signature (`cache_remote_secret`, engine/remote/index.py), a truncated object or a sha256 mismatch is
logged in one line and ignored, with whatever
depends on it (a unit: the whole inductor folder, whose entries refer to each other; one NEFF folder otherwise),
and the shape compiles locally. Downloads are staged in a temp folder beside their target and moved in only
once every file of their unit verified. A store that does not answer in time is an error in status, never a
crash. Layout and concurrency: `remote_store`; the index parts: `remote_index`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from neuron_app.engine.cache.manifest import Manifest
from neuron_app.engine.records import CacheResult
from neuron_app.engine.remote.index import (
    SIGNATURE,
    STAGING_PREFIX,
    RemoteFile,
    allowed_kind,
    artifact_roots,
    merge,
    read_parts,
    scan,
    sign_part,
    unit_of,
)
from neuron_app.engine.remote.store import (
    INDEX_VERSION,
    RemoteError,
    Store,
    describe,
    sha256_file,
)

log = logging.getLogger(__name__)

#: After the store failed, compiles do not wait for it again for this long.
RETRY_AFTER_S = 60.0
WORKERS = 8


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class PullReport:
    objects: int = 0
    bytes: int = 0
    shapes: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    changed: bool = True  # False: the remote index was the one merged last time, nothing fetched


@dataclass
class PushReport:
    files: int
    uploaded: int
    uploaded_bytes: int
    total_bytes: int
    shapes: list[str]
    index: str
    seconds: float


class RemoteCache:
    """One manager's view of `cache_remote` for its fingerprint: pulls (at start, before a cold compile), the
    "remote" verdict for shapes served from pulled artifacts, pushes, and the status it shows."""

    def __init__(
        self,
        url: str | None,
        timeout_s: float,
        cache_dir: Path,
        roots: dict[str, Path],
        fingerprint: str,
        fields: dict[str, Any],
        manifest: Manifest,
        secret: str = "",
    ) -> None:
        self.url, self.timeout_s, self.cache_dir, self.roots = url, timeout_s, cache_dir, roots
        self.secret = secret  # cache_remote_secret: signs the parts pushed, checks the parts pulled
        self.fingerprint, self.fields, self.manifest = fingerprint, fields, manifest
        self._store: Store | None = None
        self._lock = threading.Lock()
        self._seen: dict[str, str] | None = None  # the index parts (key -> etag) merged by the last pull
        self._failed_at: float | None = None
        self._staging: list[Path] = []
        self.pulled_shapes: set[str] = set()
        self._status: dict[str, Any] = {
            "url": url,
            "last_pull_at": None,
            "last_pull_s": None,
            "objects_pulled": 0,
            "bytes_pulled": 0,
            "shapes_pulled": [],
            "ignored": 0,
            "last_error": None,
        }

    @classmethod
    def for_manager(cls, manager: Any) -> RemoteCache:
        settings = manager.settings
        roots = artifact_roots(manager.backend, settings.cache_dir)
        return cls(
            settings.cache_remote,
            settings.cache_remote_timeout_s,
            settings.cache_dir,
            roots,
            manager.fingerprint,
            manager.fingerprint_fields,
            manager.manifest,
            settings.cache_remote_secret.get_secret_value() if settings.cache_remote_secret else "",
        )

    @property
    def enabled(self) -> bool:
        return self.url is not None

    @property
    def store(self) -> Store:
        if self.url is None:
            raise RemoteError("cache_remote is not set (NEURON_APP_CACHE_REMOTE=s3://bucket/prefix)")
        if self._store is None:
            self._store = Store(self.url, self.timeout_s)
        return self._store

    def instance(self) -> str:
        """This cache folder's index part name: stable across pushes, distinct between instances."""
        return hashlib.sha256(f"{socket.gethostname()}\0{self.cache_dir.resolve()}".encode()).hexdigest()[:16]

    # --- the manager's hooks ------------------------------------------------------------------------------
    def pull_once(self) -> None:
        """At start: the first pull of this process for this fingerprint."""
        if self.enabled and self._seen is None and self._failed_at is None:
            self.pull()

    def before_compile(self, name: str) -> None:
        """Before compiling a shape the local manifest lacks: the remote may have it by now."""
        if not self.enabled:
            return
        entry = self.manifest.entries().get(name)
        if entry is not None and entry.fingerprint == self.fingerprint:
            return
        if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER_S:
            return  # the store just failed: do not make every compile wait for its timeout again
        self.pull()

    def verdict(self, name: str, cache: CacheResult) -> CacheResult:
        """A persistent-cache hit on a shape whose artifacts this process pulled is a remote hit."""
        return CacheResult.REMOTE if cache is CacheResult.DISK and name in self.pulled_shapes else cache

    def snapshot(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        with self._lock:
            return {k: (list(v) if isinstance(v, list) else v) for k, v in self._status.items()}

    # --- pull ------------------------------------------------------------------------------------------------
    def pull(self) -> PullReport:
        """Fetch and install what the remote holds for this fingerprint; never raises (the report says)."""
        with self._lock:
            start = time.perf_counter()
            report = PullReport()
            try:
                self._pull(report)
                self._failed_at = None
            except Exception as exc:  # the store, the network, boto3: compile locally instead
                report.error = describe(exc)
                self._failed_at = time.monotonic()
                log.warning("remote cache %s: pull failed, compiling locally: %s", self.url, report.error)
            report.seconds = time.perf_counter() - start
            for line in report.ignored:
                log.warning("remote cache %s: %s", self.url, line)
            status = self._status
            status.update(last_pull_at=now_iso(), last_pull_s=round(report.seconds, 3), last_error=report.error)
            status["objects_pulled"] += report.objects
            status["bytes_pulled"] += report.bytes
            status["ignored"] += len(report.ignored)
            status["shapes_pulled"] = sorted(self.pulled_shapes)
            if report.changed and report.error is None:
                log.info(
                    "remote cache %s: pulled %d object(s), %d bytes, shapes %s in %.2fs (%d ignored)",
                    self.url,
                    report.objects,
                    report.bytes,
                    ", ".join(report.shapes) or "-",
                    report.seconds,
                    len(report.ignored),
                )
            return report

    def _pull(self, report: PullReport) -> None:
        store = self.store
        listed = list(store.list(self.fingerprint, "index"))
        etags = {o.key: o.etag for o in listed}
        if self._seen is not None and etags == self._seen:
            report.changed = False
            return
        merged = merge(read_parts(store, self.fingerprint, report.ignored, self.secret, listed))
        wanted: dict[str, list[tuple[RemoteFile, Path]]] = {}
        bad_units: set[str] = set()
        for remote in merged.files.values():
            unit, target = unit_of(remote.path), self._target(remote.path)
            if target is None:
                report.ignored.append(f"object {remote.path} ignored: not under an artifact folder of this backend")
                bad_units.add(unit)
            elif not allowed_kind(remote.path):
                report.ignored.append(f"object {remote.path} ignored: not a kind of file its artifact folder holds")
                bad_units.add(unit)
            elif not target.exists():
                wanted.setdefault(unit, []).append((remote, target))
        jobs = [(u, remote, target) for u, files in wanted.items() if u not in bad_units for remote, target in files]
        try:
            for unit, files in self._download(store, jobs, report).items():
                if any(staged is None for _remote, _target, staged in files):
                    bad_units.add(unit)
                    continue  # one object of the unit is bad: none of it goes in
                for remote, target, staged in files:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staged, target)  # type: ignore[arg-type]
                    report.objects += 1
                    report.bytes += remote.size
        finally:
            self._cleanup()
        self._seen = etags  # unchanged parts are not fetched again; a new push changes them
        if bad_units:  # the entries say "precompiled": only true when every artifact is in
            return
        local = self.manifest.entries()
        for name, entry in sorted(merged.entries.items()):
            if name not in local or local[name].fingerprint != self.fingerprint:
                self.manifest.record(entry)
                self.pulled_shapes.add(name)
                report.shapes.append(name)

    def _target(self, rel: str) -> Path | None:
        """The local path of a remote file, only inside a known artifact root."""
        parts = PurePosixPath(rel).parts
        root = self.roots.get(parts[0])
        if root is None:
            return None
        if len(parts) == 1:
            return root
        target = root.joinpath(*parts[1:])
        try:
            target.resolve().relative_to(root.resolve())
        except ValueError:
            return None
        return target

    def _download(
        self, store: Store, jobs: list[tuple[str, RemoteFile, Path]], report: PullReport
    ) -> dict[str, list[tuple[RemoteFile, Path, Path | None]]]:
        """Each object into a staging folder inside its root (one file system: the later move is atomic)."""
        homes: dict[Path, Path] = {}
        for _unit, remote, _target in jobs:
            home = self._home(remote.path)
            if home not in homes:
                home.mkdir(parents=True, exist_ok=True)
                homes[home] = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=home))
        self._staging = list(homes.values())

        def fetch(numbered: tuple[int, tuple[str, RemoteFile, Path]]) -> tuple[str, RemoteFile, Path, Path | None]:
            number, (unit, remote, target) = numbered
            staged = homes[self._home(remote.path)] / str(number)
            try:
                store.get_verified(
                    store.object_key(self.fingerprint, remote.sha256), staged, remote.size, remote.sha256
                )
                return unit, remote, target, staged
            except Exception as exc:
                report.ignored.append(f"object {remote.path} ({remote.sha256[:12]}...) ignored: {describe(exc)}")
                return unit, remote, target, None

        results: dict[str, list[tuple[RemoteFile, Path, Path | None]]] = {}
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            for unit, remote, target, staged in pool.map(fetch, enumerate(jobs)):
                results.setdefault(unit, []).append((remote, target, staged))
        return results

    def _home(self, rel: str) -> Path:
        """Where a file's staging folder goes: its root folder, or beside a root that is one file."""
        parts = PurePosixPath(rel).parts
        root = self.roots[parts[0]]
        return root.parent if len(parts) == 1 or root.is_file() else root

    def _cleanup(self) -> None:
        for folder in self._staging:
            shutil.rmtree(folder, ignore_errors=True)
        self._staging = []

    # --- push ---------------------------------------------------------------------------------------------
    def push(self) -> PushReport:
        """Upload this fingerprint's manifest entries and every artifact file: objects first, the index part last."""
        store, start = self.store, time.perf_counter()
        if not self.secret:
            raise RemoteError("cache_remote_secret is not set: pushed index parts must be signed", param="cache_remote")
        entries = {n: e for n, e in self.manifest.entries().items() if e.fingerprint == self.fingerprint}
        if not entries:
            raise RemoteError(
                f"no shape in {self.manifest.path} under fingerprint {self.fingerprint}: precompile first"
            )
        found = list(scan(self.roots))
        files = [RemoteFile(rel, path.stat().st_size, sha256_file(path)) for rel, path in found]
        paths = {f.sha256: path for f, (_rel, path) in zip(files, found, strict=True)}
        existing = {o.key.rsplit("/", 1)[1]: o.size for o in store.list(self.fingerprint, "objects")}
        todo = {f.sha256: f for f in files if existing.get(f.sha256) != f.size}

        def upload(remote: RemoteFile) -> None:
            store.put_file(store.object_key(self.fingerprint, remote.sha256), paths[remote.sha256], remote.sha256)

        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            list(pool.map(upload, todo.values()))
        key = store.index_key(self.fingerprint, self.instance())
        payload = {
            "version": INDEX_VERSION,
            "fingerprint": self.fingerprint,
            "fields": self.fields,
            "instance": self.instance(),
            "pushed_at": now_iso(),
            "entries": {name: asdict(e) for name, e in sorted(entries.items())},
            "files": [asdict(f) for f in files],
        }
        payload[SIGNATURE] = sign_part(self.secret, payload)  # pullers refuse a part without this signature
        store.put_json(key, payload)
        return PushReport(
            files=len(files),
            uploaded=len(todo),
            uploaded_bytes=sum(f.size for f in todo.values()),
            total_bytes=sum(f.size for f in files),
            shapes=sorted(entries),
            index=f"s3://{store.bucket}/{key}",
            seconds=time.perf_counter() - start,
        )


def list_remote(url: str, timeout_s: float, secret: str = "") -> list[dict[str, Any]]:
    """Every fingerprint under the prefix with its shapes, files and bytes (bad or unsigned parts reported)."""
    store = Store(url, timeout_s)
    listing = []
    for fingerprint in store.fingerprints():
        problems: list[str] = []
        parts = read_parts(store, fingerprint, problems, secret)
        merged = merge(parts)
        fields = parts[-1].fields if parts else {}
        listing.append(
            {
                "fingerprint": fingerprint,
                "shapes": sorted(merged.entries),
                "files": len(merged.files),
                "bytes": sum(f.size for f in merged.files.values()),
                "instances": merged.parts,
                "pushed_at": merged.pushed_at or None,
                "model": fields.get("model"),
                "device": fields.get("device"),
                "compile": f"{fields.get('compile_mode')}/{fields.get('compile_backend')}" if fields else None,
                "problems": problems,
            }
        )
    return listing
