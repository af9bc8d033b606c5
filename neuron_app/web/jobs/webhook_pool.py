"""The server's webhook deliveries: a fixed pool of workers and a bounded queue, retries scheduled, never slept.

Each finished job used to start its own delivery thread, which lived through every retry's pause: receivers that
drip or hang piled threads up without bound. Here `workers` threads take attempts in the order they are due; a
failed attempt goes back in the queue with its pause (web/jobs/webhooks.py's BACKOFF_S), so a pause holds no thread,
and each attempt has a total deadline (connect to last byte). At most `max_pending` deliveries wait or run: one
more is not queued, and its job records the delivery as failed ("the webhook delivery queue is full").
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from neuron_app.web.jobs.webhooks import BACKOFF_S, TOTAL_TIMEOUT_S, Allowlist, attempt, record_outcome

log = logging.getLogger(__name__)

QUEUE_FULL = "the webhook delivery queue is full; this delivery was not attempted"


@dataclass
class Delivery:
    url: str
    secret: str
    msg_id: str
    body: bytes
    done: Callable[[dict[str, Any]], None]  # called once with the final record
    record: dict[str, Any] = field(
        default_factory=lambda: {"delivered": False, "attempts": 0, "status": None, "last_error": None}
    )


class Deliveries:
    """Webhook deliveries of one server: `submit` queues one; `close` stops the workers (pending ones dropped)."""

    def __init__(
        self,
        allow: Allowlist,
        *,
        workers: int = 4,
        max_pending: int = 1000,
        deadline_s: float = TOTAL_TIMEOUT_S,
        backoff_s: Sequence[float] = BACKOFF_S,
    ) -> None:
        self.allow, self.max_pending, self.deadline_s, self.backoff_s = allow, max_pending, deadline_s, backoff_s
        self._due: list[tuple[float, int, Delivery]] = []  # a heap: (when, order, delivery)
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._pending = 0  # queued or being attempted
        self._closed = False
        self._workers = [threading.Thread(target=self._work, name=f"webhook-{i}", daemon=True) for i in range(workers)]
        for worker in self._workers:
            worker.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def submit(self, url: str, secret: str, msg_id: str, body: bytes, done: Callable[[dict[str, Any]], None]) -> bool:
        """Queue a delivery (its first attempt due now); False when `max_pending` are already waiting or running."""
        with self._cond:
            if self._closed or self._pending >= self.max_pending:
                log.warning("webhook %s not queued: %d deliveries are pending", msg_id, self._pending)
                return False
            self._pending += 1
            heapq.heappush(self._due, (time.monotonic(), next(self._order), Delivery(url, secret, msg_id, body, done)))
            self._cond.notify()
        return True

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    wait = self._due[0][0] - time.monotonic() if self._due else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._closed:
                    return
                _, _, delivery = heapq.heappop(self._due)
            try:
                self._attempt(delivery)
            except Exception:  # the record's callback failed (a full disk): the pool keeps working
                log.exception("webhook %s: recording the delivery failed", delivery.msg_id)

    def _attempt(self, delivery: Delivery) -> None:
        number = delivery.record["attempts"] + 1
        outcome = attempt(self.allow, delivery.url, delivery.secret, delivery.msg_id, delivery.body, self.deadline_s)
        record_outcome(delivery.record, delivery.msg_id, number, outcome)
        if outcome.final or number > len(self.backoff_s):
            with self._cond:
                self._pending -= 1
            delivery.done(dict(delivery.record))
            return
        with self._cond:  # the pause before the next attempt holds no thread
            due = time.monotonic() + self.backoff_s[number - 1]
            heapq.heappush(self._due, (due, next(self._order), delivery))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
