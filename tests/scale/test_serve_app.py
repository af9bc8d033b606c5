"""The replicas as a KubeRay RayService deploys them (neuron_app.scale.serve_app:app, built from NEURON_APP_*
variables) on an already running cluster, and a front end with ray_serve_app = "attach" serving through them and
leaving them running when it closes; the replica's spans continue the front end's trace across the handle call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from neuron_app import tracing
from tests.support import TINY_OVERRIDES, OtlpReceiver, link_models, ray_head, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with ray_head(tmp_path_factory.mktemp("ray")) as address:
        yield address


def test_a_front_end_attaches_to_the_config_deployed_replicas_and_leaves_them_running(
    cluster: str, tmp_path: Path, shared_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from ray import serve

    from neuron_app.scale import serve_app
    from neuron_app.scale.replicas import start_replicas
    from neuron_app.settings import load_settings

    cache = link_models(tmp_path / "cache", shared_models)
    receiver = OtlpReceiver()  # the replica exports its spans here (OTLP over HTTP); the front end keeps its own
    endpoint = f"http://127.0.0.1:{receiver.server_port}"
    values = TINY_OVERRIDES | {"cache_dir": str(cache), "ray_address": cluster, "otel_endpoint": endpoint}
    for name, value in values.items():  # what the RayService's pods set: the builder reads only these
        monkeypatch.setenv(f"NEURON_APP_{name.upper()}", value if isinstance(value, str) else json.dumps(value))
    # What KubeRay does with serveConfigV2 (here imperatively: the same builder, the same application name).
    ray.init(address=cluster, namespace=serve_app.NAMESPACE, logging_level="WARNING")
    try:
        serve.start(proxy_location="Disabled")
        serve.run(serve_app.app(), name=serve_app.APP_NAME, route_prefix=None)
    finally:
        ray.shutdown()
    settings = load_settings(ray_serve_app="attach")
    client = start_replicas(settings)
    try:
        wait_for(lambda: any(r["healthy"] for r in client.status().replicas), 120, "the replica on the board")
        tracing.setup(None, exporter=InMemorySpanExporter())
        with tracing.span("front end") as front:
            record: Any = client.generate("a fox", "64x64", 2, 0)
        assert record.image.size == (64, 64) and record.replica
        assert record.usage().device_seconds > 0
        trace_id = front.context.trace_id.to_bytes(16, "big")

        def replica_spans() -> set[str] | None:  # the replica's spans continue the front end's trace
            names = {span.name for span in receiver.spans if span.trace_id == trace_id}
            return names if {"replica.generate", "manager.generate", "denoise"} <= names else None

        wait_for(replica_spans, 60, "the replica's spans in the front end's trace")
    finally:
        tracing.shutdown()
        client.close()
        receiver.shutdown()
    ray.init(address=cluster, namespace="check", logging_level="WARNING")
    try:  # the RayService's application outlives the front end that attached to it
        assert serve.status().applications[serve_app.APP_NAME].status == "RUNNING"
        serve.delete(serve_app.APP_NAME)
    finally:
        ray.shutdown()
