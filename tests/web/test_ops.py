"""Operations endpoints over HTTP against the launched tiny app: /healthz, /readyz, /metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from gradio_client import Client
from prometheus_client.parser import text_string_to_metric_families

from tests.support import PATIENT_HTTP, free_port

PROMPT = "a red square on a white table"


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of the exposition `text` (None when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def get(app: Any, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(app.url.rstrip("/") + path, timeout=10, **kwargs)


def test_health_ready_and_metrics_follow_a_generate(launch_tiny: Callable[..., Any]) -> None:
    """Alive at once; not ready (503 with a reason) before the model is loaded; ready and counted after one generate.
    On an app of its own: the module's shared app has served whatever the tests before this one asked (a random
    order put a generate first, stop 59)."""
    launched_app = launch_tiny()
    client = Client(launched_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    health = get(launched_app, "/healthz")
    assert health.status_code == 200 and health.json() == {"status": "alive"}

    before = get(launched_app, "/readyz")
    assert before.status_code == 503
    assert before.json()["ready"] is False and "not loaded" in before.json()["reason"]

    scrape = get(launched_app, "/metrics")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    assert metric(scrape.text, "neuron_app_requests_total", result="ok") == 0
    assert metric(scrape.text, "neuron_app_model_loaded") == 0
    assert metric(scrape.text, "neuron_app_queue_length") == 0

    client.predict(PROMPT, "64x64", 2, 7, api_name="/generate")

    after = get(launched_app, "/readyz")
    assert after.status_code == 200, after.text
    assert after.json()["ready"] is True and "64x64" in after.json()["ready_shapes"]

    text = get(launched_app, "/metrics").text
    assert metric(text, "neuron_app_requests_total", result="ok") == 1
    assert metric(text, "neuron_app_generation_seconds_count", shape="64x64") == 1
    assert metric(text, "neuron_app_request_seconds_count", shape="64x64") == 1
    assert metric(text, "neuron_app_compiles_total", shape="64x64") == 1
    assert metric(text, "neuron_app_compile_seconds_count", shape="64x64") == 1
    assert metric(text, "neuron_app_cache_results_total", kind="miss") == 1
    assert metric(text, "neuron_app_model_loaded") == 1
    assert metric(text, "neuron_app_shapes", state="ready") == 1
    assert metric(text, "neuron_app_build_info", model="tiny", device="cpu") == 1

    # The same shape again is a memory hit and compiles nothing.
    client.predict(PROMPT, "64x64", 2, 8, api_name="/generate")
    text = get(launched_app, "/metrics").text
    assert metric(text, "neuron_app_requests_total", result="ok") == 2
    assert metric(text, "neuron_app_cache_results_total", kind="memory") == 1
    assert metric(text, "neuron_app_compiles_total", shape="64x64") == 1
    # both stages, idle now; the device's idle share between the two requests' device work (output/postprocess.py)
    for stage in ("device", "post"):
        assert metric(text, "neuron_app_stage_requests", stage=stage, state="waiting") == 0
        assert metric(text, "neuron_app_stage_requests", stage=stage, state="running") == 0
    assert 0 <= metric(text, "neuron_app_device_idle_fraction") < 1


def test_refused_request_is_counted(launched_app: Any, client: Client) -> None:
    """A request the manager refuses (unlisted shape) counts as refused, not as ok or failed."""
    before = get(launched_app, "/metrics").text
    with pytest.raises(Exception, match="not offered"):
        client.predict(PROMPT, "96x96", 2, 1, api_name="/generate")
    after = get(launched_app, "/metrics").text
    refused = metric(after, "neuron_app_requests_total", result="refused")
    assert refused == metric(before, "neuron_app_requests_total", result="refused") + 1
    assert metric(after, "neuron_app_requests_total", result="failed") == 0


def test_ops_routes_leave_gradio_routes_alone(launched_app: Any) -> None:
    """The extra routes are matched first but only on their own paths: the page and Gradio's API still answer."""
    page = get(launched_app, "/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert get(launched_app, "/gradio_api/info").status_code == 200
    assert get(launched_app, "/healthz/nothing").status_code == 404


def test_each_app_has_its_own_registry(launched_app: Any) -> None:
    """A second Metrics over the same manager registers without clashing and counts the same events."""
    from neuron_app.web.metrics import Metrics

    launched_app.manager.generate(PROMPT, "64x64", 1, 2)  # compiled whichever tests ran before: a memory hit next
    second = Metrics(launched_app.manager)
    try:
        launched_app.manager.generate(PROMPT, "64x64", 1, 3)
        text, _ = second.render()
        assert metric(text.decode(), "neuron_app_requests_total", result="ok") == 1
        assert metric(text.decode(), "neuron_app_cache_results_total", kind="memory") == 1
    finally:
        second.close()
    launched_app.manager.generate(PROMPT, "64x64", 1, 4)
    text, _ = second.render()
    assert metric(text.decode(), "neuron_app_requests_total", result="ok") == 1  # unsubscribed: no longer moves


def test_metrics_need_the_app_credentials_when_auth_is_set(make_settings: Any, monkeypatch: Any) -> None:
    """With basic auth configured, /metrics asks for the same credentials; health and readiness stay open."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.web.server import build_app, launch

    monkeypatch.setenv("NEURON_APP_AUTH_USERNAME", "ops")
    monkeypatch.setenv("NEURON_APP_AUTH_PASSWORD", "s3cret-pass")
    settings = make_settings(server_port=free_port())
    app = build_app(settings, PipelineManager(settings))
    launch(app, block=False)
    app.url = f"http://127.0.0.1:{settings.server_port}/"
    try:
        assert get(app, "/healthz").status_code == 200
        assert get(app, "/readyz").status_code == 503
        denied = get(app, "/metrics")
        assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Basic")
        assert get(app, "/metrics", auth=("ops", "wrong")).status_code == 401
        granted = get(app, "/metrics", auth=("ops", "s3cret-pass"))
        assert granted.status_code == 200 and "neuron_app_requests_total" in granted.text
    finally:
        app.demo.close()
        app.ops.close()


def test_readyz_turns_503_while_draining_for_shutdown(make_settings: Any) -> None:
    """A load balancer must stop sending work once SIGTERM started the drain."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.web.ops import Ops

    manager = PipelineManager(make_settings())
    manager.compile_shape("64x64")
    ops = Ops(manager.settings, manager, None)
    assert ops.readiness()[0] is True
    assert manager.drain(5) is True
    ready, body = ops.readiness()
    assert ready is False and body["reason"] == "the server is shutting down"


def test_readyz_after_a_restart_counts_the_precompiled_shapes(make_settings: Any) -> None:
    """The first hour's item 10: with every shape in the cache folder, a restarted server loaded its model but stayed
    503 until a first request, which a load balancer checking /readyz would never send. A precompiled shape counts
    (its first request loads graphs from the folder), and the answer names it."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.web.ops import Ops

    settings = make_settings(resolutions=["64x64"], default_resolution="64x64")
    first = PipelineManager(settings)
    first.generate(PROMPT, "64x64", 2, 7)  # compiles 64x64 and writes it to the manifest
    restarted = PipelineManager(settings)  # a new process's manager on the same folder
    ops = Ops(settings, restarted)
    ready, body = ops.readiness()
    assert not ready and "not loaded" in body["reason"]  # not before the model is
    restarted.ensure_loaded()
    ready, body = ops.readiness()
    assert ready, body
    assert body["ready_shapes"] == [] and body["precompiled_shapes"] == ["64x64"]
    assert restarted.status().compiles == 0  # nothing was compiled to get there
