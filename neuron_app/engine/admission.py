"""Admission for graceful shutdown: device work is counted in, and `drain` refuses new work and waits.

Kept apart from the manager so that anything that fronts device work (the manager, a replica) drains the same way.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from neuron_app import tracing
from neuron_app.engine.records import RequestFailed
from neuron_app.errors import ShuttingDown


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


_T = TypeVar("_T")


class Admitted:
    """What every front of device work (the manager, the replicas' client) shows of its `admission`."""

    admission: Admission

    @property
    def in_flight(self) -> int:
        """Work admitted and not finished: running plus waiting for the device."""
        return self.admission.in_flight

    @property
    def draining(self) -> bool:
        """True once `drain` was called: new work is refused."""
        return self.admission.draining

    def drain(self, timeout: float) -> bool:
        """Refuse new work; wait up to `timeout` s for the work in flight (False if time ran out)."""
        return self.admission.drain(timeout)


def admitted(method: Callable[..., _T]) -> Callable[..., _T]:
    """Mark a manager method as device work that `drain` waits for; refused with `ShuttingDown` once draining."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> _T:
        with self.admission.admit():
            return method(self, *args, **kwargs)

    return wrapper


def trace_attributes(record: Any) -> dict[str, Any]:
    """A generation's span attributes: shape, steps, graph key (the shape that compiled it), cache, compiles."""
    fields = {
        "shape": record.resolution,
        "steps": record.steps,
        "cache": str(record.cache),
        "compiled": record.compiled,
        "eager_compiles": record.eager_compiles,
        "lora": record.lora,
        "replica": record.replica or "in-process",
    }
    return {k: v for k, v in fields.items() if v is not None}


def reports_failures(method: Callable[..., _T]) -> Callable[..., _T]:
    """Report a call that raises to observers (metrics) as `RequestFailed`; successes emit their own record."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> _T:
        with tracing.span(f"manager.{method.__name__}") as span:
            try:
                record = method(self, *args, **kwargs)
            except Exception as exc:
                self._emit(RequestFailed.of(exc))
                raise
            if span is not None:  # what the trace is searched by
                span.set_attributes(trace_attributes(record))
            return record

    return wrapper
