"""Background warm-up: compile the chosen shapes after the page is up, reporting progress as data."""

from __future__ import annotations

import logging
import threading
from typing import Any

from neuron_app.engine.modes.edit_graphs import parse_label
from neuron_app.errors import CompileFailed, RequestError, ShuttingDown

log = logging.getLogger(__name__)


class Warmup:
    """Runs `warmup` (none | precompiled | all) for one manager in a daemon thread."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {"mode": manager.settings.warmup, "running": False, "pending": [], "done": []}
        self.thread: threading.Thread | None = None

    def order(self) -> list[str]:
        """The shapes warm-up compiles: none, the default shape (what the page preselects: once it is ready,
        /readyz says 200 and a first click does not wait on a compile), those valid in the manifest (edit graphs
        included), or all."""
        manager = self.manager
        mode = manager.settings.warmup
        if mode == "none":
            return []
        if mode == "default":
            return [manager.settings.default_resolution]
        names = [str(r) for r in manager.resolutions]
        if mode == "all":
            return names
        entries = manager.manifest.entries()
        edits = sorted(n for n in entries if parse_label(n) and manager.settings.max_references)  # precompiled edits
        return [
            n for n in [*names, *edits] if manager.manifest.validity(n, manager.fingerprint, entries) == "precompiled"
        ]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {k: (list(v) if isinstance(v, list) else v) for k, v in self._state.items()}

    def _pulls(self) -> bool:
        """cache_remote with warmup = precompiled: the pull at load may bring shapes, so the order is read again."""
        return self.manager.settings.warmup == "precompiled" and self.manager.remote.enabled

    def start(self) -> threading.Thread | None:
        order = self.order()
        if not order and not self._pulls() and not self.manager.settings.load_on_start:
            return None
        with self._lock:
            self._state.update(running=True, pending=list(order), done=[])
        self.thread = threading.Thread(target=self._work, args=(order,), name="warmup", daemon=True)
        self.thread.start()
        return self.thread

    def _work(self, order: list[str]) -> None:
        try:
            self.manager.ensure_loaded()
            if self._pulls():
                order = self.order()
                with self._lock:
                    self._state["pending"] = list(order)
            for name in order:
                try:
                    self.manager.compile_shape(name)
                except CompileFailed as exc:
                    log.warning("warm-up: %s", exc)
                except ShuttingDown:
                    log.info("warm-up stopped: the server is shutting down")
                    return
                except RequestError as exc:  # a manifest edit whose bucket is no longer configured
                    log.warning("warm-up: skipping %s: %s", name, exc)
                with self._lock:
                    self._state["pending"].remove(name)
                    self._state["done"].append(name)
        except Exception:
            log.exception("warm-up stopped")
        finally:
            with self._lock:
                self._state["running"] = False


def warm_shape_free_ops(pipe: Any, backend: Any, settings: Any) -> None:
    """Where eager ops compile per signature (Neuron), the ops a shape's warm-up cannot meet, measured on
    neuron-emulated: a prompt that fills max_sequence_length (no padding: the text encoder's attention takes
    another path, one more compile), and the scheduler's timesteps for every step count a request may ask
    (two small ops per count). None of them depend on the image shape: once per process, then cached."""
    import copy

    import numpy as np
    import torch
    from diffusers.pipelines.flux2.pipeline_flux2_klein import retrieve_timesteps

    with backend.device_work(), torch.inference_mode():
        prompt = " ".join(["warm-up"] * settings.max_sequence_length)
        pipe.encode_prompt(prompt=prompt, max_sequence_length=settings.max_sequence_length)
        device = pipe._execution_device
        for steps in range(1, settings.max_steps + 1):
            sigmas = np.linspace(1.0, 1 / steps, steps)
            retrieve_timesteps(copy.deepcopy(pipe.scheduler), steps, device, sigmas=sigmas, mu=1.0)
    backend.synchronize()
