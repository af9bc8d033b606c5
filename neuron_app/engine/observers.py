"""Observers of what the manager reports (records, outcomes, refusals): metrics subscribe here.

One implementation for the in-process manager and the replicas' client, so both notify the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Listener = Callable[[Any], None]


class Observers:
    """Listeners called with every event; a failing listener is logged and never breaks the request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` with every `GenerationRecord`, `CompileOutcome` and `RequestFailed`; returns unsubscribe."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def emit(self, event: Any) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("listener failed")
