"""Loading the pipeline once per process: the manager's load path, apart from compiling (compile/shape_compiler.py)
and the request path (manager.py). `placement = "auto"` is decided here, at the first load; the LoRA slot, the
compile mode and the VAE's decode go in before any graph compiles."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from neuron_app.engine.compile.compiler import apply_compile
from neuron_app.engine.model import placement
from neuron_app.engine.model.loader import load_pipeline
from neuron_app.engine.model.vae import TileSpec, install_host_decode, install_tiled_decode
from neuron_app.engine.records import ProgressCallback, ProgressEvent
from neuron_app.errors import ModelLoadError, one_line

log = logging.getLogger(__name__)


class PipelineLoader:
    """Mixed into PipelineManager, whose state (settings, backend, source, placement, adapters, counters) it loads."""

    _pipe: Any
    _load_lock: threading.Lock
    _state_lock: threading.RLock
    _loading: bool
    _load_s: float | None
    _load_error: str | None

    @property
    def loaded(self) -> bool:
        return self._pipe is not None

    @property
    def pipe(self) -> Any:
        return self._pipe

    def ensure_loaded(self, progress: ProgressCallback | None = None) -> Any:
        if self._pipe is not None:
            return self._pipe
        if progress:  # also while another thread (load_on_start) loads: this request waits on it
            progress(ProgressEvent("loading", message=self.load_times.words(), estimate=self.load_times.estimate()))
        with self._load_lock:
            if self._pipe is not None:
                return self._pipe
            self.remote.pull_once()  # what the remote holds for this fingerprint, before anything compiles
            with self._state_lock:
                self._loading = True
            start = time.perf_counter()
            try:
                import torch

                self._choose_placement()
                pipe = load_pipeline(
                    self.settings,
                    self.source,
                    self.backend.torch_device(),
                    getattr(torch, self.dtype_name),
                    tp_mesh=getattr(self.lockstep, "mesh", None),
                    sharded_load=self.backend.sharded_load,
                    placement=self.placement,
                    device_at=self.backend.torch_device_at,
                    switch=self.backend,
                )
                self.adapters.prepare(pipe)  # the LoRA slot goes in before compiling
                apply_compile(pipe.transformer, self.settings.compile_mode, self.counter)
                host: tuple[Any, ...] = ()
                if self.vae_compiled:
                    spec = TileSpec(self.settings.vae_tile, self.settings.vae_tile_overlap)
                    install_tiled_decode(pipe, spec, self.vae_counter)
                elif self.vae_on_host:
                    host = install_host_decode(pipe).modules
                self.backend.adopt(pipe, host, self.placement)  # the emulator: weights and graphs on their cores
                self.adapters.synchronize = self.backend.synchronize
                with self.backend.device_work():
                    self.adapters.warm()
            except Exception as exc:
                with self._state_lock:
                    self._load_error = str(exc) if isinstance(exc, ModelLoadError) else one_line(exc)
                raise
            finally:
                with self._state_lock:
                    self._loading = False
            with self._state_lock:
                self._pipe = pipe
                self._load_s = time.perf_counter() - start
                self._load_error = None
            self.load_times.record(self._load_s)  # the next start's "loading the model (~N s)"
            log.info(
                "loaded %s on %s (%s, compile %s/%s) in %.1fs",
                self.settings.model,
                self.backend.name,
                self.dtype_name,
                self.settings.compile_mode,
                self.compile_backend,
                self._load_s,
            )
            return pipe

    def _choose_placement(self) -> None:
        """`placement = "auto"`: the plan's first fitting placement, decided once, at the first load."""
        if self.placement.name is None and self.core_ids is not None:
            chosen = placement.choose(self.settings, self.core_ids, self.backend)
            with self._state_lock:
                self.placement = chosen
