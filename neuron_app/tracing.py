"""Traces with OpenTelemetry: one trace per request, off unless `otel_endpoint` or OTEL_EXPORTER_OTLP_ENDPOINT is set.

Every wing calls `span(...)`; while tracing is off it is a no-op that imports nothing, so the SDK (and its OTLP
over HTTP exporter) is imported only by `setup` when an endpoint is set. The app keeps its own TracerProvider
(never the global one), so tests can install an in-memory exporter and take it away again. The trace context
crosses threads (`capture`/`attached`: the jobs' workers) and Ray Serve's handle call (`inject`/`extract`: a dict
of W3C `traceparent` headers in the request's fields); the answer carries `traceparent`, and log lines the trace id.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
SERVICE = "neuron-app"
_state: dict[str, Any] = {}  # "provider", "tracer", "propagator" while tracing is on


def endpoint_of(settings: Any) -> str | None:
    """The OTLP/HTTP endpoint: the `otel_endpoint` setting, else the SDK's standard variable; None: off."""
    return getattr(settings, "otel_endpoint", None) or os.environ.get(ENV_ENDPOINT) or None


def check_installed(settings: Any) -> None:
    """With an endpoint set, OpenTelemetry's SDK and exporter must import: one line saying what to install, at
    start and before the heavy imports, instead of a `ModuleNotFoundError` traceback."""
    if endpoint_of(settings) is None:
        return
    import importlib.util

    needed = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
    try:
        missing = [name for name in needed if importlib.util.find_spec(name) is None]
    except ModuleNotFoundError:  # a parent package absent altogether
        missing = list(needed)
    if missing:
        from neuron_app.errors import SettingsError

        raise SettingsError(
            f"a trace endpoint is set (otel_endpoint or {ENV_ENDPOINT}) but OpenTelemetry is not installed "
            f"({', '.join(missing)}): pip install -r requirements-tracing.txt, or unset the endpoint"
        )


def setup(settings: Any, exporter: Any = None) -> bool:
    """Turn tracing on when an endpoint is set (or for `exporter`, the tests' in-memory one); True when on."""
    endpoint = endpoint_of(settings)
    if exporter is None and endpoint is None:
        return False
    if exporter is None:
        check_installed(settings)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    shutdown()
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", SERVICE)}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint.rstrip("/")
        url = url if url.endswith("/v1/traces") else url + "/v1/traces"  # the variable names the base URL
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=10)))
        log.info("traces go to %s (OTLP over HTTP)", shown_endpoint(url))
    _state.update(
        provider=provider, tracer=provider.get_tracer("neuron_app"), propagator=TraceContextTextMapPropagator()
    )
    _install_log_filter()
    return True


def enabled() -> bool:
    return "tracer" in _state


def shutdown() -> None:
    """Flush and stop (the app's exit; tests between setups)."""
    provider = _state.pop("provider", None)
    _state.clear()
    if provider is not None:
        provider.shutdown()


def flush() -> None:
    if "provider" in _state:
        _state["provider"].force_flush()


@contextlib.contextmanager
def span(name: str, kind: str | None = None, **attributes: Any) -> Iterator[Any]:
    """A child of the current span (a new trace at an entry); None while tracing is off."""
    tracer = _state.get("tracer")
    if tracer is None:
        yield None
        return
    from opentelemetry import trace

    span_kind = getattr(trace.SpanKind, kind.upper()) if kind else trace.SpanKind.INTERNAL
    with tracer.start_as_current_span(name, kind=span_kind, attributes=_clean(attributes)) as current:
        yield current


def start(name: str, **attributes: Any) -> Any:
    """A span ended by its caller (`end(span)`): phases that begin and end in different callbacks."""
    tracer = _state.get("tracer")
    return None if tracer is None else tracer.start_span(name, attributes=_clean(attributes))


@contextlib.contextmanager
def using(current: Any) -> Iterator[None]:
    """Make a `start`ed span the current one (its children nest under it); it stays open after."""
    if current is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(current, end_on_exit=False):
        yield


def end(current: Any, **attributes: Any) -> None:
    if current is not None and current.is_recording():
        current.set_attributes(_clean(attributes))
        current.end()


def annotate(**attributes: Any) -> None:
    """Attributes on the current span (shape, steps, graph key, cache, eager_compiles, replica, LoRA)."""
    if "tracer" in _state:
        from opentelemetry import trace

        trace.get_current_span().set_attributes(_clean(attributes))


def traceparent() -> str | None:
    """The current span's W3C `traceparent` (for the answer's header); None while off."""
    return inject().get("traceparent")


def inject() -> dict[str, str]:
    """The current context as W3C headers (a dict that pickles: it crosses Ray's handle call)."""
    carrier: dict[str, str] = {}
    if "propagator" in _state:
        _state["propagator"].inject(carrier)
    return carrier


@contextlib.contextmanager
def attached(carrier: Any) -> Iterator[None]:
    """Run in the trace of `carrier`: W3C headers (from `inject`, or an HTTP request's headers)."""
    if "propagator" not in _state or not carrier:
        yield
        return
    with resumed(_state["propagator"].extract(carrier)):
        yield


@contextlib.contextmanager
def resumed(captured: Any) -> Iterator[None]:
    """Run in a context `capture()` took in another thread."""
    if captured is None or "tracer" not in _state:
        yield
        return
    from opentelemetry import context

    token = context.attach(captured)
    try:
        yield
    finally:
        context.detach(token)


@contextlib.contextmanager
def holding(lock: Any) -> Iterator[None]:
    """Hold `lock` (the device), its wait a `queue` span: the time another request had the device."""
    with span("queue"):
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def capture() -> Any:
    """This thread's context, to attach in another thread (a job's worker)."""
    if "propagator" not in _state:
        return None
    from opentelemetry import context

    return context.get_current()


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """OTel takes str, bool, int, float (and lists of them): None dropped, the rest as text."""
    return {
        k: (v if isinstance(v, str | bool | int | float) else str(v)) for k, v in attributes.items() if v is not None
    }


class _TraceIdFilter(logging.Filter):
    """Log lines written inside a span end with its trace id (`trace=<32 hex>`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "tracer" in _state and not getattr(record, "_traced", False):
            from opentelemetry import trace

            context = trace.get_current_span().get_span_context()
            if context.is_valid:
                record.msg = f"{record.getMessage()} trace={context.trace_id:032x}"
                record.args = ()
                record._traced = True  # type: ignore[attr-defined]
        return True


def _install_log_filter() -> None:
    root = logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, _TraceIdFilter) for f in handler.filters):
            handler.addFilter(_TraceIdFilter())


def shown_endpoint(url: str) -> str:
    """The endpoint as the log may show it: no query string, and no user or password (issue 45, row 48)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, ("***@" if "@" in parts.netloc else "") + netloc, parts.path, "", ""))
