"""Usage per API key, interface and day: a small SQLite table beside the job store, read by /metrics and `python -m
neuron_app usage`.

Each answered request adds its `usage` to its row of the day (UTC), by the interface it came through (`page`,
`gradio_api` for gradio_client and other HTTP clients of the named endpoints, `mcp`, `openai`) and, on the OpenAI API,
its key; a request without a key counts as "-". Each of its images is a row of `images` too, with the end user it was
for (OpenAI's `safety_identifier`, or `user`), so an operator can say who used what behind one key. No server of its
own: the table is a file in the cache folder, so the command reads it whether the app runs or not (and, next to it, the
jobs by status from jobs.sqlite3).
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from neuron_app.engine.records import GenerationRecord, Usage
from neuron_app.web.jobs.sqlite_file import open_checked

PREFIX = "neuron_app"
NO_KEY = "-"
#: How `usage --users` shows an image booked with no end user (its `--json` says null): no string a caller sends
#: prints as this, since the table shows each user in quotes.
NO_USER = "(none)"
#: What a row adds up, in the order the command prints them.
MEASURES = ("requests", "images", "output_megapixels", "input_megapixels", "compile_s", "inference_s", "device_seconds")
#: The entries a request comes through (web/access.py `entry_of` names the Gradio ones).
INTERFACES = ("page", "gradio_api", "mcp", "openai")
OPENAI = "openai"
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS usage (day TEXT NOT NULL, key_name TEXT NOT NULL, "
    f"interface TEXT NOT NULL DEFAULT '{OPENAI}', "
    + ", ".join(f"{m} REAL NOT NULL DEFAULT 0" for m in MEASURES)
    + ", PRIMARY KEY (day, key_name, interface))"
)
#: One row per image: when, for which key and which end user (`user` / `safety_identifier`), and what it cost.
IMAGES_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS images (created REAL NOT NULL, day TEXT NOT NULL, key_name TEXT NOT NULL, "
    "user TEXT, resolution TEXT NOT NULL, steps INTEGER NOT NULL, output_megapixels REAL NOT NULL, "
    f"device_seconds REAL NOT NULL, interface TEXT NOT NULL DEFAULT '{OPENAI}')"
)
IMAGE_COLUMNS = "created, day, key_name, user, resolution, steps, output_megapixels, device_seconds, interface"


def _columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in db.execute(f"PRAGMA table_info({table})")]


def _create(db: sqlite3.Connection) -> None:
    """The tables; a book written before the `interface` column (the OpenAI API's alone) is carried over as such."""
    old = _columns(db, "usage")
    if old and "interface" not in old:
        db.execute("ALTER TABLE usage RENAME TO usage_before_interfaces")
        db.execute(SCHEMA)
        names = ", ".join(["day", "key_name", *MEASURES])
        db.execute(f"INSERT INTO usage ({names}) SELECT {names} FROM usage_before_interfaces")
        db.execute("DROP TABLE usage_before_interfaces")
    db.execute(SCHEMA)
    if _columns(db, "images") and "interface" not in _columns(db, "images"):
        db.execute(f"ALTER TABLE images ADD COLUMN interface TEXT NOT NULL DEFAULT '{OPENAI}'")
    db.execute(IMAGES_SCHEMA)


def today(stamp: float | None = None) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() if stamp is None else stamp))


class UsageBook:
    """The usage table; one connection behind a lock (autocommit, WAL), like the job store."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        # A corrupt file is kept aside with one ERROR line and the book starts empty (issue 45, row 40).
        self._db = open_checked(path, _create, "usage book", "starting with no usage")

    def add(
        self, key_name: str | None, usage: Usage, images: int, *, day: str | None = None, interface: str = OPENAI
    ) -> None:
        """One answered request of `images` images that cost `usage` (summed over its images)."""
        values = {
            "requests": 1,
            "images": images,
            "output_megapixels": usage.output_megapixels,
            "input_megapixels": usage.input_megapixels,
            "compile_s": usage.compile_s,
            "inference_s": usage.inference_s,
            "device_seconds": usage.device_seconds,
        }
        names = ", ".join(values)
        updates = ", ".join(f"{m} = {m} + excluded.{m}" for m in values)
        sql = (
            f"INSERT INTO usage (day, key_name, interface, {names}) VALUES (?, ?, ?, {', '.join('?' * len(values))}) "
            f"ON CONFLICT (day, key_name, interface) DO UPDATE SET {updates}"
        )
        with self._lock:
            self._db.execute(sql, (day or today(), key_name or NO_KEY, interface, *values.values()))

    def charge(
        self,
        key_name: str | None,
        records: list[GenerationRecord],
        waited_s: float = 0.0,
        *,
        user: str | None = None,
        interface: str = OPENAI,
    ) -> dict[str, Any]:
        """The answer's `usage` (its images summed; `waited_s` before the device queue added), booked to the key
        and the interface; each image booked with the end user it was for."""
        usages = [r.usage() for r in records]
        usage = Usage.total(usages)
        if waited_s:
            usage = dataclasses.replace(usage, queue_s=round(usage.queue_s + waited_s, 4))
        self.add(key_name, usage, len(records), interface=interface)
        now = time.time()
        rows = [
            (now, today(now), key_name or NO_KEY, user, r.resized_to or r.resolution, u.steps, u.output_megapixels,
             u.device_seconds, interface)
            for r, u in zip(records, usages, strict=True)
        ]  # fmt: skip
        with self._lock:
            self._db.executemany(f"INSERT INTO images ({IMAGE_COLUMNS}) VALUES ({', '.join('?' * 9)})", rows)
        return usage.to_dict()

    def book(self, interface: str, records: list[GenerationRecord]) -> None:
        """What the page, gradio_client or MCP made (no API key there): booked as the OpenAI API's answers are."""
        if records:
            self.charge(None, records, interface=interface)

    def images(self, since: str | None = None) -> list[dict[str, Any]]:
        """Every image booked from `since` (a YYYY-MM-DD day) on, oldest first, with its end user."""
        with self._lock:
            cursor = self._db.execute("SELECT * FROM images WHERE day >= ? ORDER BY created", (since or "0000-00-00",))
            names = [c[0] for c in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def rows(self, since: str | None = None) -> list[dict[str, Any]]:
        """Every (day, key, interface) row from `since` (a YYYY-MM-DD day) on, oldest first."""
        with self._lock:
            cursor = self._db.execute(
                "SELECT * FROM usage WHERE day >= ? ORDER BY day, key_name, interface", (since or "0000-00-00",)
            )
            names = [c[0] for c in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def collector(self) -> UsageCollector:
        return UsageCollector(self)

    def close(self) -> None:
        with self._lock:
            self._db.close()


class UsageCollector:
    """/metrics: today's usage per key, `neuron_app_key_usage_today{key, day, measure}` (resets at 00:00 UTC)."""

    def __init__(self, book: UsageBook) -> None:
        self.book = book

    def collect(self) -> Iterator[Metric]:
        day = today()
        family = GaugeMetricFamily(
            f"{PREFIX}_key_usage_today",
            "Usage of the OpenAI API per key today (UTC): requests, images, megapixels, compile, inference and "
            "device seconds.",
            labels=["key", "day", "measure"],
        )
        for row in self.book.rows(since=day):
            if row["interface"] != OPENAI:  # the keys are the OpenAI API's; `usage` shows the other interfaces
                continue
            for measure in MEASURES:
                family.add_metric([row["key_name"], day, measure], row[measure])
        yield family


def job_counts(path: Path, since: str | None = None) -> dict[tuple[str, str], dict[str, int]]:
    """(day, key) -> jobs by status, from the job store (jobs.sqlite3), read-only; empty when there is none."""
    if not path.is_file():
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT created, key_name, status FROM jobs").fetchall()
    finally:
        db.close()
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for created, key_name, status in rows:
        day = today(created)
        if since is None or day >= since:
            per = counts.setdefault((day, key_name or NO_KEY), {})
            per[status] = per.get(status, 0) + 1
    return counts


def users_table(cache_dir: Path, since: str | None = None) -> list[dict[str, Any]]:
    """The command's `--users` rows: images, megapixels and device seconds per day, key and end user."""
    path = cache_dir / "usage.sqlite3"
    if not path.is_file():
        return []
    book = UsageBook(path)
    try:
        images = book.images(since)
    finally:
        book.close()
    rows: dict[tuple[str, str, str | None], dict[str, Any]] = {}
    for image in images:
        key = (image["day"], image["key_name"], image["user"])  # None (no user sent) is apart from any string
        row = rows.setdefault(key, {"day": key[0], "key_name": key[1], "user": key[2], "images": 0,
                                    "output_megapixels": 0.0, "device_seconds": 0.0})  # fmt: skip
        row["images"] += 1
        row["output_megapixels"] = round(row["output_megapixels"] + image["output_megapixels"], 6)
        row["device_seconds"] = round(row["device_seconds"] + image["device_seconds"], 4)
    return list(rows.values())


def usage_table(cache_dir: Path, since: str | None = None) -> list[dict[str, Any]]:
    """The command's rows: the usage table joined with the jobs by status (the OpenAI API's), per day, key and
    interface."""
    path = cache_dir / "usage.sqlite3"
    rows: list[dict[str, Any]] = []
    if path.is_file():
        book = UsageBook(path)
        rows, _ = book.rows(since), book.close()
    jobs = job_counts(cache_dir / "jobs.sqlite3", since)
    seen = {(r["day"], r["key_name"]) for r in rows if r["interface"] == OPENAI}
    rows += [
        {"day": d, "key_name": k, "interface": OPENAI} | dict.fromkeys(MEASURES, 0)
        for d, k in jobs
        if (d, k) not in seen
    ]
    for row in rows:
        row["jobs"] = jobs.get((row["day"], row["key_name"]), {}) if row["interface"] == OPENAI else {}
    return sorted(rows, key=lambda r: (r["day"], r["key_name"], r["interface"]))
