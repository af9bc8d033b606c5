"""The jobs table of the asynchronous OpenAI API (web/jobs/jobs.py), kept bounded and opened defensively.

Stored state outlives the process that wrote it, so it is read as untrusted: a `jobs.sqlite3` that is not a
database (overwritten, truncated, a disk fault) is kept aside as `jobs.sqlite3.corrupt-<time>` and the server
starts with no jobs, logging one line, rather than refusing to start. The store stays bounded on its own:
a background thread deletes jobs past `ttl_s` and, oldest first, ended jobs whose images exceed the count or
byte cap (an index on `finished` keeps it cheap at a million rows; submits never scan). Each key holds at most
`max_active` queued or running jobs and `max_stored` jobs in all. A clean close checkpoints the WAL into the
database, so nothing is left in `-wal` after a stop.
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_app.errors import RateLimited, one_line
from neuron_app.web.jobs.sqlite_file import open_checked

log = logging.getLogger(__name__)

RESTARTED = {
    "message": "the server restarted before this job finished; submit it again",
    "type": "server_error",
    "param": None,
    "code": "server_restarted",
}
SCHEMA = """CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, key_name TEXT, status TEXT NOT NULL, created REAL NOT NULL, started REAL,
    finished REAL, size TEXT, response_format TEXT, count INTEGER, result TEXT, error TEXT,
    webhook_url TEXT, webhook TEXT, images INTEGER NOT NULL DEFAULT 0, bytes INTEGER NOT NULL DEFAULT 0)"""
#: Columns added after the first release: a store written by an older version gets them on open.
ADDED = {"images": "INTEGER NOT NULL DEFAULT 0", "bytes": "INTEGER NOT NULL DEFAULT 0"}
INDEXES = (
    "CREATE INDEX IF NOT EXISTS jobs_by_finished ON jobs (finished)",
    "CREATE INDEX IF NOT EXISTS jobs_by_key ON jobs (key_name, status)",
    # The jobs that hold images (bounded by the image caps): summed and evicted without a table scan.
    "CREATE INDEX IF NOT EXISTS jobs_with_images ON jobs (finished) WHERE images > 0",
)
#: Rows deleted per transaction by the pruner: the lock is never held for long.
BATCH = 500


@dataclass(frozen=True)
class Caps:
    """How much the store holds: per key (queued or running; in all) and of images (count, bytes)."""

    max_active: int = 0  # 0 = no cap, for each of them
    max_stored: int = 0
    max_images: int = 0
    max_bytes: int = 0

    def exceeded(self, images: int, size: int) -> bool:
        return bool((self.max_images and images > self.max_images) or (self.max_bytes and size > self.max_bytes))


def open_database(path: Path) -> sqlite3.Connection:
    """The jobs database at `path`, checked; a corrupt file kept aside (web/jobs/sqlite_file.py)."""
    return open_checked(path, _prepare, "job store", "starting with no jobs")


def _prepare(db: sqlite3.Connection) -> None:
    db.execute(SCHEMA)
    present = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    for name, kind in ADDED.items():
        if name not in present:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
    for sql in INDEXES:
        db.execute(sql)


class JobStore:
    """The jobs table; one connection behind a lock (sqlite3 in autocommit, WAL), and its pruning thread."""

    def __init__(self, path: Path, files: Path, ttl_s: float, caps: Caps | None = None) -> None:
        self.files, self.ttl_s, self.caps = files, ttl_s, caps or Caps()
        self._lock = threading.Lock()
        self._db = open_database(path)
        self._wake, self._stop = threading.Event(), threading.Event()
        self._pruner: threading.Thread | None = None

    def start_pruning(self, every_s: float | None = None) -> None:
        """Prune now and then every `every_s` seconds (default: a tenth of the TTL, at most a minute) or when
        woken (a job stored images), on a thread of its own."""
        period = every_s if every_s is not None else min(60.0, self.ttl_s / 10)

        def loop() -> None:
            try:  # once per start: image folders no row names (their store was corrupt and kept aside)
                self.sweep_orphans()
            except OSError as exc:
                log.warning("job store: orphan image folders not swept: %s", one_line(exc, limit=200))
            while not self._stop.is_set():
                try:
                    self.prune()
                except Exception as exc:  # a full disk: said once per round, and the next round tries again
                    log.warning("job store pruning failed: %s", one_line(exc, limit=200))
                self._wake.wait(period)
                self._wake.clear()

        self._pruner = threading.Thread(target=loop, name="job-store-pruner", daemon=True)
        self._pruner.start()

    def wake(self) -> None:
        self._wake.set()

    def mark_restarted(self) -> list[dict[str, Any]]:
        """Jobs queued or running when the last process ended: failed now, returned (for their webhooks)."""
        with self._lock:
            rows = self._rows("SELECT * FROM jobs WHERE status IN ('queued', 'running')")
            self._db.execute(
                "UPDATE jobs SET status = 'failed', error = ?, finished = ? WHERE status IN ('queued', 'running')",
                (json.dumps(RESTARTED), time.time()),
            )
        return rows

    def insert(self, row: dict[str, Any]) -> None:
        """Store a new job; RateLimited `jobs_full` when its key holds as many jobs as the caps allow."""
        names = ", ".join(row)
        key, caps = row.get("key_name"), self.caps
        with self._lock:
            if caps.max_active:
                (active,) = self._db.execute(
                    "SELECT COUNT(*) FROM jobs WHERE key_name IS ? AND status IN ('queued', 'running')", (key,)
                ).fetchone()
                if active >= caps.max_active:
                    raise _full(f"{active} jobs of this key are queued or running (at most {caps.max_active})")
            if caps.max_stored:
                (stored,) = self._db.execute("SELECT COUNT(*) FROM jobs WHERE key_name IS ?", (key,)).fetchone()
                if stored >= caps.max_stored:
                    raise _full(
                        f"this key holds {stored} jobs (at most {caps.max_stored}) until they expire after "
                        f"{self.ttl_s:.0f} s",
                        retry_after_s=60.0,
                    )
            self._db.execute(f"INSERT INTO jobs ({names}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))

    def update(self, job_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{name} = ?" for name in fields)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*fields.values(), job_id))

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            rows = self._rows("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return rows[0] if rows else None

    def totals(self) -> tuple[int, int]:
        """Stored job images: how many, and their bytes."""
        with self._lock:
            images, size = self._db.execute(
                "SELECT COALESCE(SUM(images), 0), COALESCE(SUM(bytes), 0) FROM jobs WHERE images > 0"
            ).fetchone()
        return int(images), int(size)

    def prune(self) -> int:
        """Delete jobs that ended more than `ttl_s` ago, then the oldest ended jobs with images while the images
        exceed their caps; each with its image files. Returns how many jobs were deleted."""
        cutoff = time.time() - self.ttl_s
        deleted = 0
        while True:
            with self._lock:
                ids = [r[0] for r in self._db.execute(
                    "SELECT id FROM jobs WHERE finished IS NOT NULL AND finished < ? LIMIT ?", (cutoff, BATCH)
                )]  # fmt: skip
                self._delete(ids)
            deleted += len(ids)
            if len(ids) < BATCH:
                break
        caps = self.caps
        if caps.max_images or caps.max_bytes:
            deleted += self._over_caps()
        return deleted

    def _over_caps(self) -> int:
        """Delete the oldest ended jobs with images, just enough to bring the images under both caps."""
        caps, deleted = self.caps, 0
        images, size = self.totals()
        while caps.exceeded(images, size):
            with self._lock:
                oldest = self._db.execute(
                    "SELECT id, images, bytes FROM jobs WHERE finished IS NOT NULL AND images > 0 "
                    "ORDER BY finished LIMIT ?",
                    (BATCH,),
                ).fetchall()
                ids = []
                for job_id, count, nbytes in oldest:
                    if not caps.exceeded(images, size):
                        break
                    ids.append(job_id)
                    images, size = images - count, size - nbytes
                self._delete(ids)
            if not ids:
                break  # only running jobs hold the rest: they end, and a later round deletes
            deleted += len(ids)
            log.info("job store: %d ended job(s) deleted early, their images over the cap", len(ids))
        return deleted

    def sweep_orphans(self) -> int:
        """Delete image folders of jobs the table does not know (a fresh store after a corrupt one)."""
        if not self.files.is_dir():
            return 0
        swept = 0
        for folder in self.files.iterdir():
            if folder.is_dir() and not folder.is_symlink() and self.get(folder.name) is None:
                shutil.rmtree(folder, ignore_errors=True)
                swept += 1
        if swept:
            log.info("job store: %d image folder(s) of unknown jobs deleted", swept)
        return swept

    def _delete(self, ids: list[str]) -> None:
        """Rows and their files (under the lock: a job id is never reused, so no one writes them again)."""
        if not ids:
            return
        self._db.execute(f"DELETE FROM jobs WHERE id IN ({', '.join('?' * len(ids))})", ids)
        for job_id in ids:
            shutil.rmtree(self.files / job_id, ignore_errors=True)

    def close(self) -> None:
        """Stop pruning, move the WAL into the database and close it: a clean stop leaves no `-wal` data."""
        self._stop.set()
        self._wake.set()
        if self._pruner is not None:
            self._pruner.join(timeout=30)
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                log.warning("job store: the WAL could not be checkpointed at close: %s", one_line(exc, limit=200))
            self._db.close()

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        cursor = self._db.execute(sql, args)
        names = [c[0] for c in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _full(message: str, retry_after_s: float = 5.0) -> RateLimited:
    return RateLimited(f"too many jobs: {message}; try again later", code="jobs_full", retry_after_s=retry_after_s)
