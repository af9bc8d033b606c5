"""Traces with OpenTelemetry: one OpenAI request (the `openai` SDK) is one trace whose spans cover the entry,
validation, the queue, the compile, the prompt cache and text encoder, denoise, decode, safety, marks and the
response, each under its parent; the answer carries `traceparent` and log lines the trace id. With the SDK's
in-memory exporter in process, and with `python app.py` exporting OTLP over HTTP (protobuf) to a local receiver."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from neuron_app import tracing
from tests.support import AppProcess, OtlpReceiver, openai_client, wait_for

PHASES = {"queue", "prompt_cache", "text_encoder", "denoise", "decode", "safety", "marks"}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def exported(launch_tiny: Callable[..., Any]) -> Iterator[tuple[InMemorySpanExporter, Any, Lines]]:
    lines, logger = Lines(), logging.getLogger("neuron_app")
    level, logger.level = logger.level, logging.INFO
    logging.getLogger().addHandler(lines)
    exporter = InMemorySpanExporter()
    tracing.setup(None, exporter=exporter)
    try:
        yield exporter, launch_tiny(), lines
    finally:
        tracing.shutdown()
        logging.getLogger().removeHandler(lines)
        logger.setLevel(level)


def test_one_request_is_one_trace_with_every_phase_under_its_parent(exported: Any) -> None:
    exporter, app, lines = exported
    raw = openai_client(app).images.with_raw_response.generate(
        prompt="a lighthouse", size="128x64", extra_body={"num_inference_steps": 2}
    )
    assert raw.parse().data
    version, trace_hex, _span_hex, _flags = raw.headers["traceparent"].split("-")
    assert version == "00" and len(trace_hex) == 32
    spans = [s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_hex]
    by_name: dict[str, list[Any]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (entry,) = by_name["POST /v1/images/generations"]
    assert entry.parent is None and entry.attributes["http.response.status_code"] == 200
    assert {"validation", "manager.run", "compile", "response", *PHASES} <= set(by_name), sorted(by_name)
    ids = {s.context.span_id: s for s in spans}

    def parent(span: Any) -> str:
        return ids[span.parent.span_id].name

    (run,) = by_name["manager.run"]
    assert parent(run) == "POST /v1/images/generations" and parent(by_name["validation"][0]) == parent(run)
    assert run.attributes["shape"] == "128x64" and run.attributes["steps"] == 2 and run.attributes["cache"] == "miss"
    assert run.attributes["eager_compiles"] == 0 and run.attributes["replica"] == "in-process"
    (compile_span,) = by_name["compile"]
    assert parent(compile_span) == "manager.run" and compile_span.attributes["shape"] == "128x64"
    assert compile_span.attributes["graphs"] >= 1 and "graph_key" in compile_span.attributes
    assert [parent(s) for s in by_name["queue"]] == ["manager.run"]
    # the host work after the device (engine/output/postprocess.py) runs on its own thread, still in the request's trace
    assert [parent(s) for s in by_name["postprocess"]] == ["manager.run"]
    assert [parent(s) for s in by_name["safety"]] == ["postprocess"]
    # the request's own denoise and decode run under manager.run; the compile's warm-up run nests under it
    assert sorted(parent(s) for s in by_name["denoise"]) == ["compile", "manager.run"]
    assert {parent(s) for s in by_name["decode"]} == {"compile", "manager.run"}
    assert any(parent(s) == "manager.run" for s in by_name["prompt_cache"])
    assert [parent(s) for s in by_name["marks"]] == ["postprocess"] and parent(by_name["response"][0]) == entry.name
    assert by_name["denoise"][0].attributes["steps"] in (2, app.settings.default_steps)
    logged = [line for line in lines.lines if line.startswith("generate 128x64")]
    assert logged and all(line.endswith(f"trace={trace_hex}") for line in logged), logged


def test_a_callers_traceparent_is_continued_and_a_carrier_crosses_like_the_replica_hop(exported: Any) -> None:
    """The entry continues the caller's trace; `inject`/`attached` (what ReplicaClient and ReplicaServer do around
    Ray's handle call) make the far side's spans children of the near side's."""
    exporter, app, _lines = exported
    caller = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    raw = openai_client(app).images.with_raw_response.generate(
        prompt="a lighthouse",
        size="64x64",
        extra_body={"num_inference_steps": 1},
        extra_headers={"traceparent": caller},
    )
    assert raw.headers["traceparent"].split("-")[1] == "ab" * 16
    with tracing.span("front end") as near:
        carrier = tracing.inject()
    with tracing.attached(carrier), tracing.span("replica.generate") as far:
        pass
    assert far.context.trace_id == near.context.trace_id and far.parent.span_id == near.context.span_id
    assert exporter.get_finished_spans()  # they were exported


@pytest.mark.slow
def test_python_app_py_exports_one_trace_over_otlp_http(run_app_py: Callable[..., AppProcess]) -> None:
    receiver = OtlpReceiver()
    try:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        app = run_app_py(env=env)
        app.wait_up(timeout=240)
        raw = openai_client(app).images.with_raw_response.generate(
            prompt="over the wire", size="64x64", extra_body={"num_inference_steps": 2}
        )
        trace_id = bytes.fromhex(raw.headers["traceparent"].split("-")[1])

        # Every span the request makes, the route's own last: it ends after the answer is sent, so it may come in a
        # later export batch than the others (a busy machine at stop 62 caught the receiver between the two).
        wanted = {"POST /v1/images/generations", "manager.run", "compile", "response", *PHASES}

        def names() -> set[str] | None:
            got = {s.name for s in receiver.spans if s.trace_id == trace_id}
            return got if wanted <= got else None

        got = wait_for(names, 120, "the request's spans at the receiver")
        assert wanted <= got
    finally:
        receiver.shutdown()


def test_tracing_is_off_and_the_sdk_not_imported_without_an_endpoint() -> None:
    """No endpoint: `setup` says off, spans are no-ops, and neither the SDK nor the API is imported."""
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    code = (
        "import sys; from neuron_app import tracing; from neuron_app.settings import load_settings\n"
        "on = tracing.setup(load_settings(model='tiny'))\n"
        "with tracing.span('x') as s: pass\n"
        "print(on, s, tracing.traceparent(), any(m.startswith('opentelemetry') for m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEURON_APP_"))}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "None", "None", "False"], out.stdout + out.stderr


def test_the_logged_trace_endpoint_has_no_credentials() -> None:
    """Issue 45, row 48: `traces go to ...` printed `user:password@` from the endpoint (only a query was cut)."""
    from neuron_app.tracing import shown_endpoint

    shown = shown_endpoint("http://otel-user:s3cr3t-token@127.0.0.1:7925/v1/traces?key=abc")
    assert shown == "http://***@127.0.0.1:7925/v1/traces"
    assert shown_endpoint("https://collector:4318/v1/traces") == "https://collector:4318/v1/traces"
