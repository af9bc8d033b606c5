"""How long loading the model took last time, kept in the cache folder: the page can say "loading the model
(~12 s)" after a restart instead of a bare spinner."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

from neuron_app.engine.cache.estimates import Estimate, estimate_words

log = logging.getLogger(__name__)

FILE_NAME = "load-times.json"


class LoadTimes:
    """`load-times.json`: seconds of the last model load, per model and device (a different model loads in a
    different time). Best effort: an unreadable file is no estimate, never an error."""

    def __init__(self, cache_dir: Path, key: str) -> None:
        self.path, self.key = cache_dir / FILE_NAME, key

    def _read(self) -> dict[str, float]:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.path.read_text())
            if isinstance(data, dict):
                return {k: float(v) for k, v in data.items() if isinstance(v, int | float)}
        return {}

    def estimate(self) -> Estimate | None:
        seconds = self._read().get(self.key)
        return None if seconds is None else Estimate(seconds, "load", "the model's last load, measured", "measured")

    def words(self) -> str:
        """The loading event's message: the model and how long it should take."""
        found = self.estimate()
        return f"Loading the model ({estimate_words(None if found is None else found.seconds)})"

    def record(self, seconds: float) -> None:
        data = self._read() | {self.key: round(seconds, 2)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".load-times-", dir=self.path.parent)
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not record the model's load time in %s: %s", self.path.parent, exc)
