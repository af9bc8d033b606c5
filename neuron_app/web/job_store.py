"""The jobs table of web/jobs.py: SQLite in the cache folder, one connection behind a lock.

A finished job reads the same after a restart until `job_ttl_s`; a job that a restart cut off is marked failed.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

RESTARTED = {
    "message": "the server restarted before this job finished; submit it again",
    "type": "server_error",
    "param": None,
    "code": "server_restarted",
}
SCHEMA = """CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, key_name TEXT, status TEXT NOT NULL, created REAL NOT NULL, started REAL,
    finished REAL, size TEXT, response_format TEXT, count INTEGER, result TEXT, error TEXT,
    webhook_url TEXT, webhook TEXT)"""


class JobStore:
    """The jobs table; one connection behind a lock (sqlite3 in autocommit, WAL)."""

    def __init__(self, path: Path, files: Path, ttl_s: float) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.files, self.ttl_s = files, ttl_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(SCHEMA)

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
        names = ", ".join(row)
        with self._lock:
            self._db.execute(f"INSERT INTO jobs ({names}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))

    def update(self, job_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{name} = ?" for name in fields)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*fields.values(), job_id))

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            rows = self._rows("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return rows[0] if rows else None

    def prune(self) -> int:
        """Delete jobs that ended more than `ttl_s` ago, with their image files."""
        cutoff = time.time() - self.ttl_s
        with self._lock:
            ids = [
                r["id"]
                for r in self._rows("SELECT id FROM jobs WHERE finished IS NOT NULL AND finished < ?", (cutoff,))
            ]
            self._db.execute("DELETE FROM jobs WHERE finished IS NOT NULL AND finished < ?", (cutoff,))
        for job_id in ids:
            shutil.rmtree(self.files / job_id, ignore_errors=True)
        return len(ids)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        cursor = self._db.execute(sql, args)
        names = [c[0] for c in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
