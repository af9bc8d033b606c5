"""Many replicas behind Ray Serve, fixed or following the queue."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, WrapValidator


class Auto(int):
    """A count the topology may choose (`replicas`, `tp_degree` = "auto"): 1 until the front process settles it
    (scale/topology.py), and it knows it was not given."""

    auto: bool

    def __new__(cls, value: int = 1, auto: bool = False) -> Auto:
        obj = super().__new__(cls, value)
        obj.auto = auto
        return obj

    def __getnewargs__(self) -> tuple[int, bool]:  # pickled to the replicas with the settings
        return (int(self), self.auto)


def auto_count(value: Any, handler: Any) -> Auto:
    """ "auto" (the topology's), else the field's own int checks."""
    if isinstance(value, Auto):
        return value
    if isinstance(value, str) and value.strip().lower() == "auto":
        return Auto(1, auto=True)
    return Auto(handler(value))


class ReplicaRange(Auto):
    """`replicas` as an int (its maximum, what every caller sizes by: lanes, Ray CPUs) that also knows its minimum:
    "1-4" scales between 1 and 4 replicas with the queue (Ray Serve autoscaling); a plain 2 is min = max = 2;
    "auto" is the topology's copies (1 until it is chosen)."""

    min: int

    def __new__(cls, maximum: int, minimum: int | None = None, auto: bool = False) -> ReplicaRange:
        obj = super().__new__(cls, maximum, auto)
        obj.min = maximum if minimum is None else minimum
        return obj

    @property
    def max(self) -> int:
        return int(self)

    def __getnewargs__(self) -> tuple[int, int, bool]:  # type: ignore[override]
        return (int(self), self.min, self.auto)


def _replica_range(value: Any, handler: Any) -> ReplicaRange:
    """An int, "MIN-MAX" (each checked by the field's bounds; MIN above MAX is refused), or "auto"."""
    if isinstance(value, ReplicaRange):
        return value
    if isinstance(value, str) and value.strip().lower() == "auto":
        return ReplicaRange(1, auto=True)
    if isinstance(value, str) and "-" in value.strip().lstrip("-"):
        low, _, high = value.strip().partition("-")
        minimum, maximum = handler(low.strip()), handler(high.strip())
        if minimum > maximum:
            raise ValueError(f"replicas {value!r}: MIN is above MAX (write MIN-MAX, e.g. 1-4)")
        return ReplicaRange(maximum, minimum)
    return ReplicaRange(handler(value))


class ReplicaSettings(BaseModel):
    """How many replicas (or a MIN-MAX range), autoscaling's pace, the Ray cluster, cores per replica."""

    replicas: Annotated[int, WrapValidator(_replica_range)] = Field(
        1,
        ge=1,
        le=256,
        validate_default=True,
        description="Model replicas serving in parallel, each with its own cores, behind Ray Serve; "
        '1 (and no ray_address) serves in this process without Ray; "MIN-MAX" (e.g. "1-4") scales between '
        'them with the queue (Ray Serve autoscaling); "auto": as many copies as the topology lays on the cores '
        "held (python -m neuron_app plan --best).",
    )

    topology_goal: Literal["throughput", "latency"] = Field(
        "throughput",
        description='What replicas = "auto" and tp_degree = "auto" maximise: the instance\'s images per second '
        "(throughput), or the shortest time per image (latency).",
    )

    topology: dict[str, Any] | None = Field(
        None,
        description="The topology the front process chose (scale/topology.py), passed to its replicas and ranks; "
        "set by the app, not by hand.",
    )

    autoscale_target_ongoing: float = Field(
        1.0,
        gt=0.0,
        description='With replicas = "MIN-MAX": requests per replica (running plus queued at it) that Ray Serve '
        "aims at; above it a replica is added (each replica runs one request at a time).",
    )

    autoscale_upscale_delay_s: float = Field(
        30.0,
        ge=0.0,
        description='With replicas = "MIN-MAX": how long the load must stay high before a replica is added.',
    )

    autoscale_downscale_delay_s: float = Field(
        600.0,
        ge=0.0,
        description='With replicas = "MIN-MAX": how long the load must stay low before a replica is removed (a new '
        "replica loads the model and its graphs again).",
    )

    ray_address: str | None = Field(
        None,
        description="Ray cluster to join ('auto', 'host:port', 'ray://...'); unset: with replicas > 1 the app "
        "starts a local Ray instance itself and stops it on exit.",
    )

    ray_serve_app: Literal["deploy", "attach"] = Field(
        "deploy",
        description='With ray_address: "deploy" deploys the replicas from this process; "attach" serves through '
        "the replicas a KubeRay RayService deployed (serveConfigV2 import_path neuron_app.scale.serve_app:app), "
        "waiting for them, and leaves them running on exit.",
    )

    cores_per_replica: int = Field(
        1,
        ge=1,
        description="CPUs (and torch threads) each replica asks Ray for on CPU and neuron-emulated; GPUs on CUDA. "
        "On Neuron a replica's cores are its topology block (TP x its placement's cores), not this setting.",
    )

    @property
    def replicas_min(self) -> int:
        """Fewest replicas: MIN of "MIN-MAX", else `replicas`."""
        return getattr(self.replicas, "min", int(self.replicas))

    @property
    def replicas_max(self) -> int:
        """Most replicas: MAX of "MIN-MAX", else `replicas` (the int value of `replicas` either way)."""
        return int(self.replicas)

    @property
    def autoscaling(self) -> bool:
        """replicas = "MIN-MAX" with MIN < MAX: Ray Serve adds and removes replicas with the queue."""
        return self.replicas_min < self.replicas_max

    @property
    def uses_replicas(self) -> bool:
        """Serve through Ray Serve replicas instead of an in-process manager."""
        return self.replicas > 1 or bool(self.ray_address)
