"""Admission for graceful shutdown: device work is counted in, and `drain` refuses new work and waits.

Kept apart from the manager so that anything that fronts device work (the manager, a replica) drains the same way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from neuron_app.engine.requests import ShuttingDown


class Admission:
    """Counts device work in flight; once draining, `admit` raises `ShuttingDown`."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._inflight = 0
        self._draining = False

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        with self._idle:
            if self._draining:
                raise ShuttingDown("the server is shutting down; try again in a moment")
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    @property
    def in_flight(self) -> int:
        """Work admitted and not finished: running plus waiting for the device."""
        return self._inflight

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, timeout: float) -> bool:
        """Refuse new work from now on and wait up to `timeout` s for the work in flight; True when none is left."""
        with self._idle:
            self._draining = True
            return self._idle.wait_for(lambda: self._inflight == 0, timeout=max(0.0, timeout))
