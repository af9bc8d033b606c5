"""Prometheus metrics of one app, fed by the manager's events.

Each app gets its own `CollectorRegistry` (never the process-global one), so several apps can
live in one process (the tests build many) without "duplicated timeseries" errors. Counters
and histograms move on manager events; gauges that describe the current state (model loaded,
shape states, queue) are read from the manager and the queue when Prometheus scrapes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from neuron_app.engine.contract import Manager
from neuron_app.engine.records import CompileOutcome, GenerationRecord, RequestFailed, ShapeState

log = logging.getLogger(__name__)

PREFIX = "neuron_app"
REQUEST_RESULTS = ("ok", "refused", "failed", "cancelled")
CACHE_KINDS = ("miss", "memory", "disk", "remote")
#: Tiny CPU images take ~0.2 s, a 1 MP image on a NeuronCore a few seconds, big shapes with many steps a minute.
GENERATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)
#: aot_eager compiles in ~2 s, inductor in ~30 s, Neuron in minutes (large models up to an hour).
COMPILE_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 2400, 3600)

QueueLength = Callable[[], int | None]


class _StateCollector(Collector):
    """Gauges read at scrape time: what the manager and the queue say right now."""

    def __init__(self, manager: Manager, queue_length: QueueLength) -> None:
        self.manager = manager
        self.queue_length = queue_length

    def collect(self) -> Iterator[Metric]:
        status = self.manager.status()
        yield InfoMetricFamily(
            f"{PREFIX}_build",
            "What this server runs; the fingerprint keys the compile cache.",
            value={
                "model": status.model,
                "device": status.device,
                "dtype": status.dtype,
                "compile_mode": status.compile_mode,
                "compile_backend": status.compile_backend,
                "tp_degree": str(status.tp_degree),
                "fingerprint": status.fingerprint,
            },
        )
        yield GaugeMetricFamily(f"{PREFIX}_model_loaded", "1 once the pipeline is loaded.", value=int(status.loaded))
        shapes = GaugeMetricFamily(f"{PREFIX}_shapes", "Configured shapes by compile state.", labels=["state"])
        for state in ShapeState:
            shapes.add_metric([str(state)], sum(1 for s in status.shapes.values() if s.state is state))
        yield shapes
        yield CounterMetricFamily(
            f"{PREFIX}_compile_failures", "Graphs the compiler refused since start.", value=status.compile_failures
        )
        graphs = CounterMetricFamily(
            f"{PREFIX}_graphs_compiled", "Graphs compiled since start, by component.", labels=["component"]
        )
        vae_graphs = status.vae_compiles
        graphs.add_metric(["transformer"], status.compiles - vae_graphs)
        graphs.add_metric(["vae"], vae_graphs)
        yield graphs
        cache = status.prompt_cache
        prompts = CounterMetricFamily(
            f"{PREFIX}_prompt_cache",
            "Prompt-embedding cache lookups: hit (the text encoder was skipped) or miss (it ran).",
            labels=["result"],
        )
        prompts.add_metric(["hit"], cache.get("hits", 0))
        prompts.add_metric(["miss"], cache.get("misses", 0))
        yield prompts
        safety = status.safety or {}
        checked = CounterMetricFamily(
            f"{PREFIX}_safety_images",
            "Images the safety checker classified: passed (returned) or flagged (refused, never stored).",
            labels=["result"],
        )
        for result in ("passed", "flagged"):
            checked.add_metric([result], safety.get(result, 0))
        yield checked
        yield GaugeMetricFamily(
            f"{PREFIX}_cache_size_bytes", "Size of the persistent cache folder.", value=status.cache_size_bytes
        )
        remote = status.remote or {}
        if remote:  # cache_remote (S3): what the pulls installed and what they refused
            pulled = CounterMetricFamily(
                f"{PREFIX}_remote_objects",
                "Objects from cache_remote: pulled (verified and installed) or ignored (failed a check).",
                labels=["result"],
            )
            pulled.add_metric(["pulled"], remote.get("objects_pulled", 0))
            pulled.add_metric(["ignored"], remote.get("ignored", 0))
            yield pulled
        yield from _stage_gauges(status.stages or {})
        yield from _replica_gauges(status.replicas)
        length = self.queue_length()
        if length is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_queue_length", "Generation requests waiting or running in the queue.", value=length
            )


def _stage_gauges(stages: dict[str, Any]) -> Iterator[Metric]:
    """A request's two stages (output/postprocess.py): waiting and running on the device lane and in the post slots."""
    if not stages:
        return
    depth = GaugeMetricFamily(
        f"{PREFIX}_stage_requests",
        "Requests per stage (device: the device lane; post: the host slots for safety, marks, encode), by state.",
        labels=["stage", "state"],
    )
    for stage in ("device", "post"):
        for state in ("waiting", "running"):
            depth.add_metric([stage, state], stages.get(stage, {}).get(state, 0))
    yield depth
    idle = stages.get("device", {}).get("idle_fraction")
    if idle is not None:
        yield GaugeMetricFamily(
            f"{PREFIX}_device_idle_fraction",
            "Share of the time the device lane sat idle between its last holds (up to 256).",
            value=idle,
        )


def _replica_gauges(replicas: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per-replica gauges (Ray Serve replicas); nothing in-process."""
    if not replicas:
        return
    families = {
        "healthy": GaugeMetricFamily(
            f"{PREFIX}_replica_healthy", "1 while the replica publishes its status.", labels=["replica"]
        ),
        "in_flight": GaugeMetricFamily(
            f"{PREFIX}_replica_in_flight", "Requests running or waiting on the replica.", labels=["replica"]
        ),
        "ready_shapes": GaugeMetricFamily(
            f"{PREFIX}_replica_ready_shapes", "Shapes the replica has compiled and ready.", labels=["replica"]
        ),
    }
    for rep in replicas:
        families["healthy"].add_metric([rep["id"]], int(rep["healthy"]))
        families["in_flight"].add_metric([rep["id"]], rep["in_flight"])
        families["ready_shapes"].add_metric([rep["id"]], len(rep["ready_shapes"]))
    yield from families.values()


class Metrics:
    """The app's metrics; `observe` is subscribed to the manager on creation, `close` unsubscribes."""

    def __init__(self, manager: Manager, queue_length: QueueLength | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Generation requests by result: ok, refused (invalid request), failed (load, compile or run error), "
            "cancelled (stopped at a step by its caller).",
            ["result"],
            registry=self.registry,
        )
        self.generation_seconds = Histogram(
            f"{PREFIX}_generation_seconds",
            "Denoising and decoding time of successful requests, per shape (compile excluded).",
            ["shape"],
            buckets=GENERATION_BUCKETS,
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_seconds",
            "Whole successful requests, per shape: waiting for the model, compiling and generating.",
            ["shape"],
            buckets=GENERATION_BUCKETS + COMPILE_BUCKETS[COMPILE_BUCKETS.index(600) :],
            registry=self.registry,
        )
        self.compiles = Counter(
            f"{PREFIX}_compiles",
            "Shape compiles that produced new graphs, per shape.",
            ["shape"],
            registry=self.registry,
        )
        self.compile_seconds = Histogram(
            f"{PREFIX}_compile_seconds",
            "Seconds of the compiles counted by neuron_app_compiles_total, per shape.",
            ["shape"],
            buckets=COMPILE_BUCKETS,
            registry=self.registry,
        )
        self.queue_seconds = Histogram(
            f"{PREFIX}_queue_seconds",
            "Seconds successful requests waited for the device (another request held it), per shape.",
            ["shape"],
            buckets=GENERATION_BUCKETS,
            registry=self.registry,
        )
        self.device_seconds = Histogram(
            f"{PREFIX}_device_seconds",
            "Seconds successful requests held the device (their compile or graph load and their generation), "
            "per shape.",
            ["shape"],
            buckets=GENERATION_BUCKETS + COMPILE_BUCKETS[COMPILE_BUCKETS.index(600) :],
            registry=self.registry,
        )
        self.cache_results = Counter(
            f"{PREFIX}_cache_results",
            "What each successful request found: miss (compiled now), memory (compiled earlier in this "
            "process), disk (compiled now from the persistent cache), remote (from artifacts pulled from "
            "cache_remote).",
            ["kind"],
            registry=self.registry,
        )
        for result in REQUEST_RESULTS:  # present at 0 from the start, so rates work from the first scrape
            self.requests.labels(result)
        for kind in CACHE_KINDS:
            self.cache_results.labels(kind)
        self.registry.register(_StateCollector(manager, queue_length or (lambda: None)))
        self._unsubscribe = manager.subscribe(self.observe)

    def observe(self, event: Any) -> None:
        """Manager listener: one event in, the matching series moved."""
        if isinstance(event, GenerationRecord):
            self.requests.labels("ok").inc()
            self.generation_seconds.labels(event.resolution).observe(event.inference_s)
            self.request_seconds.labels(event.resolution).observe(event.total_s)
            self.queue_seconds.labels(event.resolution).observe(event.queue_s)
            self.device_seconds.labels(event.resolution).observe(event.device_s)
            self.cache_results.labels(str(event.cache)).inc()
        elif isinstance(event, CompileOutcome):
            if event.compiled:
                self.compiles.labels(event.resolution).inc()
                self.compile_seconds.labels(event.resolution).observe(event.compile_s)
        elif isinstance(event, RequestFailed):
            self.requests.labels(event.result if event.result in REQUEST_RESULTS else "failed").inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        self._unsubscribe()
