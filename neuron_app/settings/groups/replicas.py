"""Many replicas behind Ray Serve, fixed or following the queue."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, WrapValidator


class ReplicaRange(int):
    """`replicas` as an int (its maximum, what every caller sizes by: lanes, Ray CPUs) that also knows its minimum:
    "1-4" scales between 1 and 4 replicas with the queue (Ray Serve autoscaling); a plain 2 is min = max = 2."""

    min: int

    def __new__(cls, maximum: int, minimum: int | None = None) -> ReplicaRange:
        obj = super().__new__(cls, maximum)
        obj.min = maximum if minimum is None else minimum
        return obj

    @property
    def max(self) -> int:
        return int(self)

    def __getnewargs__(self) -> tuple[int, int]:  # pickled to the replicas with the settings
        return (int(self), self.min)


def _replica_range(value: Any, handler: Any) -> ReplicaRange:
    """An int, or "MIN-MAX" (each checked by the field's bounds); MIN above MAX is refused."""
    if isinstance(value, ReplicaRange):
        return value
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
        "them with the queue (Ray Serve autoscaling).",
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
        description="Cores each replica asks Ray for: NeuronCores (the neuron_cores resource) on Neuron, "
        "GPUs on CUDA, CPUs (and torch threads) on CPU. On Neuron a replica asks for at least the cores its "
        "placement holds (text-encoder-apart: 2).",
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
