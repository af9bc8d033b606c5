"""Images answered as `url` by the OpenAI-compatible API: unguessable names that expire, served from one folder."""

from __future__ import annotations

import contextlib
import re
import secrets
import threading
import time
from pathlib import Path

from neuron_app.engine.output.images import write_image
from neuron_app.engine.records import GenerationRecord
from neuron_app.engine.trust.marks import Marker

_FILE_NAME = re.compile(r"[A-Za-z0-9_-]{43}\.(png|jpeg|webp)")


class UrlStore:
    """PNGs handed out as `url`: unguessable names, each downloadable for `ttl_s` seconds, then deleted."""

    def __init__(self, folder: Path, ttl_s: float, marker: Marker | None = None) -> None:
        self.folder = folder
        self.ttl_s = ttl_s
        self.marker = marker
        self._lock = threading.Lock()

    def save(self, record: GenerationRecord, output: tuple[str, int | None] = ("png", None)) -> str:
        """The record's file (`output`: format and quality) under a fresh name; the name."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prune()
        name = f"{secrets.token_urlsafe(32)}.{output[0]}"
        write_image(record, self.folder / name, self.marker, *output)
        return name

    def find(self, name: str) -> Path | None:
        """The file for a name this store handed out and that has not expired; None for anything else."""
        if not _FILE_NAME.fullmatch(name):
            return None
        path = self.folder / name
        try:
            fresh = time.time() - path.stat().st_mtime <= self.ttl_s
        except OSError:
            return None
        return path if fresh else None

    def prune(self) -> None:
        cutoff = time.time() - self.ttl_s
        with self._lock:
            for path in self.folder.glob("*.*"):
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < cutoff:
                        path.unlink()
