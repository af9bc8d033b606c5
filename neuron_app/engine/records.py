"""What the manager reports, as data: shape states, cache results, outcomes, records and status.

The UI, the APIs, metrics and replicas read these; none of them reaches into the manager's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from neuron_app.engine.cache.estimates import Estimate
from neuron_app.engine.cache.manifest import Validity
from neuron_app.errors import Cancelled, ShuttingDown, app_error_of, one_line


class ShapeState(StrEnum):
    NOT_COMPILED = "not_compiled"
    COMPILING = "compiling"
    READY = "ready"
    FAILED = "failed"


class CacheResult(StrEnum):
    MISS = "miss"  # compiled now, from scratch
    MEMORY = "memory"  # the graph was already compiled in this process
    DISK = "disk"  # compiled now, served from the persistent cache (by the compiler's evidence)
    REMOTE = "remote"  # a persistent-cache hit on artifacts pulled from cache_remote (engine/remote/cache.py)


@dataclass(frozen=True)
class ProgressEvent:
    phase: str  # loading | compiling | denoising | decoding
    resolution: str | None = None
    step: int = 0
    total: int = 0
    message: str = ""
    graph: str = ""  # the graph compiling or loading ("256x256 + 1 ref"), when it is not `resolution` alone
    estimate: Estimate | None = None  # what that compile, graph load or model load should take


ProgressCallback = Callable[[ProgressEvent], None]


@dataclass
class CompileOutcome:
    resolution: str
    cache: CacheResult
    compiled: bool
    compile_s: float
    graphs: int
    eager_compiles: int = 0  # eager device ops compiled on first use by this compile (Neuron; 0 elsewhere)


def _megapixels(size: str) -> float:
    """ "WxH" as megapixels."""
    width, _, height = size.partition("x")
    return int(width) * int(height) / 1e6


@dataclass(frozen=True)
class Usage:
    """What one answer cost, as the caller sees it (hosted image APIs answer `cost` and megapixels; this app answers
    its own seconds). `compile_s > 0` exactly when the request compiled (or loaded) a graph; `device_seconds` is the
    time it held the device (its compile and its generation)."""

    queue_s: float
    compile_s: float
    inference_s: float
    steps: int
    output_megapixels: float
    input_megapixels: float  # the references at their buckets, and a source image and its mask at the output size
    cache: str
    eager_compiles: int
    device_seconds: float

    @classmethod
    def of(cls, record: GenerationRecord) -> Usage:
        inputs = float(sum(_megapixels(ref["bucket"]) for ref in record.references))
        if record.source is not None:
            inputs += _megapixels(record.resolution) * (2 if record.source.get("masked") else 1)
        return cls(
            queue_s=round(record.queue_s, 4),
            compile_s=max(round(record.compile_s, 4), 0.0001) if record.compiled else 0.0,
            inference_s=round(record.inference_s, 4),
            steps=record.steps,
            output_megapixels=round(_megapixels(record.resolution), 6),
            input_megapixels=round(inputs, 6),
            cache=str(record.cache),
            eager_compiles=record.eager_compiles,
            device_seconds=round(record.device_s, 4),
        )

    @classmethod
    def total(cls, usages: list[Usage]) -> Usage:
        """Several images of one request: seconds, steps, megapixels and eager compiles add up; the cache is the
        first image's (the one that may have compiled)."""
        first = usages[0]
        added = {
            name: round(sum(getattr(u, name) for u in usages), 6)
            for name in ("queue_s", "compile_s", "inference_s", "output_megapixels", "input_megapixels")
        }
        added["device_seconds"] = round(sum(u.device_seconds for u in usages), 4)
        steps, eager = sum(u.steps for u in usages), sum(u.eager_compiles for u in usages)
        return cls(**added, steps=steps, cache=first.cache, eager_compiles=eager)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GenerationRecord:
    resolution: str
    steps: int
    seed: int
    prompt: str
    cache: CacheResult
    compiled: bool
    compile_s: float
    inference_s: float
    total_s: float
    graphs_compiled: int
    model: str
    image: Any = field(default=None, repr=False)
    lora: str = "none"
    lora_scale: float = 1.0
    loras: list[dict[str, Any]] = field(
        default_factory=list
    )  # every style of the call: name and scale (lora = the first)
    lora_switch_s: float = 0.0  # the in-place LoRA switch before this call (0 when the slot already held it)
    replica: str | None = None  # which replica served it (Ray Serve); None in-process
    references: list[dict[str, str]] = field(default_factory=list)  # an edit: {"size", "bucket", "sha256"} each
    #: image-to-image or inpainting: the source {"size", "sha256", "masked", "edit_fraction", "strength"}; else None.
    source: dict[str, Any] | None = None
    #: Eager device ops this request compiled on first use (its shape's warm-up included; Neuron only, else 0).
    eager_compiles: int = 0
    #: The safety checker's verdict on this image: passed, or off (not checked). Flagged images never get a record.
    safety: str = "off"
    #: The AI-content marks its PNG carries (engine/trust/marks.py), filled in when the PNG is written.
    marks: dict[str, str] = field(default_factory=dict)
    queue_s: float = 0.0  # waiting for the device (another request held it), before this one's compile and run
    device_s: float = 0.0  # holding the device: this request's compile (or graph load) and its generation
    #: size_policy nearest: the size the image was resized and cropped to from `resolution` (engine/modes/sizing.py).
    resized_to: str | None = None
    #: Which cores held which component for this image: {"name", "cores": {"transformer": [..], ...}} (placement).
    placement: dict[str, Any] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        """The JSON-able record the API returns next to the image, with its `usage`."""
        data = asdict(self)
        data.pop("image")
        data["cache"] = str(self.cache)
        data["usage"] = self.usage().to_dict()
        return data

    def usage(self) -> Usage:
        return Usage.of(self)


@dataclass(frozen=True)
class RequestFailed:
    """A `generate` call that raised, for observers (metrics): refused = invalid request, failed = the rest."""

    result: str  # refused | failed | cancelled
    error: str

    @classmethod
    def of(cls, exc: BaseException) -> RequestFailed:
        """Refused: the request was turned away before device work (invalid, or the server is draining)."""
        known = app_error_of(exc)
        if isinstance(known, Cancelled):  # its caller stopped it at a step
            return cls("cancelled", one_line(exc))
        refused = known is not None and (known.kind == "refused" or isinstance(known, ShuttingDown))
        return cls("refused" if refused else "failed", one_line(exc))


@dataclass
class GraphState:
    """The manager's state of one graph key; `status()` reads it into `ShapeStatus` per configured shape."""

    state: ShapeState = ShapeState.NOT_COMPILED
    compile_s: float | None = None
    graphs: int = 0
    cache: CacheResult | None = None
    error: str | None = None
    compiled_as: str | None = None  # the resolution whose compile produced this graph
    eager_compiles: int = 0  # eager device ops its warm-up compiled (Neuron)
    fallback_ops: list[str] = field(default_factory=list)  # ops its own warm-up ran on the CPU, once each
    nki_attention: bool | None = None  # its transformer graphs' attention takes TorchNeuron's NKI kernel


@dataclass(frozen=True)
class ShapeStatus:
    resolution: str
    state: ShapeState
    hits: int
    compile_s: float | None
    graphs: int
    cache: str | None
    last_error: str | None
    manifest: Validity
    shared_with: str | None  # ready because this other shape compiled the same graph
    offered: bool
    estimate_s: float | None = None  # predicted seconds to make it ready (estimate.seconds); None: no history
    estimate: Estimate | None = None  # load or compile, and what the number rests on (engine/cache/estimates.py)
    ready_replicas: int | None = None  # replicas that have it ready (Ray Serve); None in-process
    eager_compiles: int = 0  # eager device ops its compile met (Neuron: each compiles once, then cached)
    #: Something its warm-up ran on the CPU instead of the device, beyond the known-cheap host glue.
    degraded: bool = False
    fallback_ops: list[str] = field(default_factory=list)  # what its warm-up ran on the CPU, host glue included
    #: Neuron: the NKI flash-attention kernel takes every attention call of its transformer graphs (TorchNeuron's
    #: gate: sequence lengths multiples of 512, head dim <= 128, no mask); None off Neuron or not compiled yet.
    nki_attention: bool | None = None


@dataclass(frozen=True)
class ManagerStatus:
    model: str
    device: str
    dtype: str
    compile_mode: str
    compile_backend: str
    tp_degree: int
    cache_dir: str
    cache_size_bytes: int
    loaded: bool
    loading: bool
    load_s: float | None
    load_error: str | None
    compiles: int
    compile_failures: int
    fingerprint: str
    warmup: dict[str, Any]
    shapes: dict[str, ShapeStatus]
    loras: list[dict[str, Any]] = field(default_factory=list)  # name, rank, source of each configured adapter
    #: Can failing device work silently run elsewhere (TorchNeuron's fallbacks)? "off (...)" is the truthful setting.
    fallback: str = ""
    #: Why this manager can no longer serve (a tensor-parallel rank died or timed out); None while it can.
    broken: str | None = None
    replicas: list[dict[str, Any]] = field(default_factory=list)  # [{id, healthy, in_flight, ready_shapes}]
    vae_compiles: int = 0  # of `compiles`, the VAE decoder's graphs (one for every shape when tiled)
    prompt_cache: dict[str, int] = field(default_factory=dict)  # hits, misses, entries, size
    #: Edit graphs compiled in this process or precompiled, by label ("64x64 + 1 ref (64x64)").
    edits: dict[str, ShapeStatus] = field(default_factory=dict)
    #: cache_remote: {url, last_pull_at, last_pull_s, objects_pulled, bytes_pulled, shapes_pulled, ignored,
    #: last_error}; empty when off.
    remote: dict[str, Any] = field(default_factory=dict)
    eager_compiles: int = 0  # eager device ops compiled by this process (Neuron and neuron-emulated)
    #: neuron-emulated only: {"mode", "violations", "violation_count", "eager_signatures", ...}; None elsewhere.
    neuron_rules: dict[str, Any] | None = None
    #: The safety checker: {"checker": on|off, "model", "passed", "flagged"} (engine/trust/safety.py).
    safety: dict[str, Any] = field(default_factory=dict)
    #: The two stages of a request (engine/output/postprocess.py): {"device": {waiting, running, served, median_s,
    #: idle_fraction}, "post": {workers, waiting, running, done, failed, seconds}}.
    stages: dict[str, Any] = field(default_factory=dict)
    #: `python -m neuron_app plan` for this model at its shapes and TP on trn2, measured before any compile
    #: ("1024x1024: fits, 14.7 of 24 GiB per core (together), floor 0.92 s per image; ..."); None when not planned.
    plan: str | None = None
    #: The `placement` setting at work: {"name", "setting", "cores": {"transformer": [..], "text_encoder": [..],
    #: "vae": [..]}, "why"}; name None while `auto` has not chosen (it chooses at load).
    placement: dict[str, Any] = field(default_factory=dict)
    #: How the instance is laid out (scale/topology.py): {"tp", "placement", "copies", "core_blocks",
    #: "images_per_s_floor", "floor_s_per_image", "goal", "why", "cores_held"}; empty where none was chosen.
    topology: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for shape in [*data["shapes"].values(), *data["edits"].values()]:
            shape["state"] = str(shape["state"])
        return data

    @property
    def ready(self) -> list[str]:
        return [r for r, s in self.shapes.items() if s.state is ShapeState.READY]
