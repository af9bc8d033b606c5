"""The manager contract: everything the front ends (web/, app.py) use of a manager, in one place.

`engine.manager.PipelineManager` (in-process) and `scale.replicas.ReplicaClient` (Ray Serve replicas) implement
it. web/ is typed with it and uses nothing else: no attribute probes, no signature sniffing, no branch for
replicas. What a manager cannot do is data here too: `supports_editing`, and `ManagerStatus.broken` (why the
manager can no longer serve, e.g. a broken tensor-parallel group).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from neuron_app.engine.observers import Listener
from neuron_app.engine.records import GenerationRecord, ManagerStatus, ProgressCallback
from neuron_app.engine.requests import Request
from neuron_app.settings import Settings


class Manager(Protocol):
    settings: Settings

    def status(self) -> ManagerStatus:
        """A snapshot for the page, the APIs and /readyz; never waits for the device."""
        ...

    def validate(
        self,
        prompt: Any,
        resolution: Any,
        steps: Any,
        seed: Any,
        *,
        lora: Any = "none",
        lora_scale: Any = 1.0,
        references: Sequence[Any] | None = None,
        **source: Any,
    ) -> Request:
        """The one validation (engine/requests.py) against what is offered now; raises `RequestError`. `source`:
        `image`, `mask`, `strength` (image-to-image, inpainting) and `previews` (the page's step previews)."""
        ...

    def run(self, request: Request, progress: ProgressCallback | None = None) -> GenerationRecord:
        """The device work of a validated request (compiling its shape first if needed)."""
        ...

    def generate(
        self,
        prompt: Any,
        resolution: Any,
        steps: Any,
        seed: Any,
        progress: ProgressCallback | None = None,
        *,
        lora: Any = "none",
        lora_scale: Any = 1.0,
        references: Sequence[Any] | None = None,
        **source: Any,
    ) -> GenerationRecord:
        """`validate`, then `run`: the raw-input entry of the Gradio API, MCP and the command line."""
        ...

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Events (`GenerationRecord`, `CompileOutcome`, `RequestFailed`) for metrics; returns unsubscribe."""
        ...

    @property
    def in_flight(self) -> int:
        """Work admitted and not finished: running plus waiting for the device."""
        ...

    @property
    def draining(self) -> bool:
        """True once `drain` was called: new work is refused with `ShuttingDown`."""
        ...

    def drain(self, timeout: float) -> bool:
        """Refuse new work; wait up to `timeout` s for the work in flight (False if time ran out)."""
        ...

    def start_warmup(self) -> threading.Thread | None:
        """Compile the warm-up shapes in the background (after the page is up)."""
        ...

    def close(self) -> None:
        """Release what the manager started (replicas and the Ray instance); nothing in-process."""
        ...

    @property
    def supports_editing(self) -> bool:
        """Whether requests may carry reference images (an edit): false with `max_references = 0`."""
        ...
