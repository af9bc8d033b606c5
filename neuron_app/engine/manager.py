"""The pipeline manager: one per process, loads once, compiles lazily per shape, reports.

Neuron compiles static shapes: each new transformer graph costs minutes. The manager keys
its compile state on what really changes the graph (`GraphKey`), serializes device work
behind one lock, refuses unlisted shapes before any model work, and tells the UI what
happened (compile states, cache results) as data. Loading the pipeline is engine/loading.py's.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from neuron_app import tracing
from neuron_app.backends import DeviceBackend, resolve_backend
from neuron_app.engine import requests
from neuron_app.engine.admission import Admission, Admitted, admitted, reports_failures
from neuron_app.engine.cache.load_times import LoadTimes
from neuron_app.engine.cache.manifest import FolderSize, Manifest, fingerprint_of
from neuron_app.engine.cache.prompt_cache import PromptCache
from neuron_app.engine.compile.compiler import CountingBackend, recompile_room
from neuron_app.engine.compile.shape_compiler import ShapeCompiler
from neuron_app.engine.compile.warmup import Warmup
from neuron_app.engine.identity import BATCH_SIZE, fingerprint_fields
from neuron_app.engine.loading import PipelineLoader
from neuron_app.engine.model import placement
from neuron_app.engine.model.loader import ModelSource, resolve_source
from neuron_app.engine.model.runner import Lockstep, PipelineCall, run_call
from neuron_app.engine.model.vae import vae_backend, vae_compiled
from neuron_app.engine.modes.edit_graphs import check_edit_compiled, parse_label
from neuron_app.engine.modes.lora import AdapterSet
from neuron_app.engine.observers import Listener, Observers
from neuron_app.engine.output.postprocess import Lane, PostStage, finish, post_workers
from neuron_app.engine.records import (
    CompileOutcome,
    GenerationRecord,
    GraphState,
    ManagerStatus,
    ProgressCallback,
)
from neuron_app.engine.remote.cache import RemoteCache
from neuron_app.engine.requests import Request
from neuron_app.engine.status_view import build_status
from neuron_app.engine.steps import StepEvents
from neuron_app.engine.trust.safety import SafetyChecker
from neuron_app.errors import Cancelled, GenerationFailed, RequestError, one_line, rule_of
from neuron_app.settings import Settings, get_settings
from neuron_app.shapes import GraphKey, Resolution

log = logging.getLogger(__name__)

__all__ = ["BATCH_SIZE", "PipelineManager", "get_manager"]


class PipelineManager(PipelineLoader, ShapeCompiler, Admitted):
    def __init__(self, settings: Settings, *, lockstep: Lockstep | None = None) -> None:
        self.settings = settings
        self.lockstep = lockstep
        self.resolutions = settings.parsed_resolutions
        self.backend: DeviceBackend = resolve_backend(settings.device, settings.cache_dir)
        self.backend.configure(settings)
        if settings.compile_mode == "auto":  # the device's default (regional on Neuron, T8), fixed for this manager
            self.settings = settings = settings.model_copy(update={"compile_mode": self.backend.default_compile_mode})
        self.compile_backend = settings.compile_backend or self.backend.default_compile_backend
        self.dtype_name = self.backend.default_dtype if settings.dtype == "auto" else settings.dtype
        self.source: ModelSource = resolve_source(settings)
        tp = settings.tp_degree
        self.core_ids = None if tp > 1 else self.backend.core_ids()  # under torchrun: one core per rank
        self.placement = placement.resolve(settings, self.core_ids)  # the topology's; refused here if short
        self.vae_on_host = settings.vae_device == "cpu"  # decode on the host: no VAE graph, no tiles
        tiles_by_default = self.backend.tiles_vae_by_default
        self.vae_compiled = not self.vae_on_host and vae_compiled(settings.vae_compile, tiles_by_default)
        self.manifest = Manifest(settings.cache_dir)
        self.load_times = LoadTimes(settings.cache_dir, f"{settings.model}@{self.backend.name}")
        self.adapters = AdapterSet(settings)  # LoRA styles; bad adapter files stop the start here
        self.fingerprint_fields = self._fingerprint_fields()
        self.fingerprint = fingerprint_of(self.fingerprint_fields)
        # every graph; vae_counter: the VAE's among them; the backend sees each graph first (the emulator's rules)
        self.counter = CountingBackend(self.compile_backend, check=self.backend.check_graph)
        self.vae_counter = self.counter.child(vae_backend(self.compile_backend))
        self.prompt_cache = PromptCache(settings.prompt_cache_size, self.fingerprint)
        self.probe = self.backend.cache_probe(self.compile_backend, settings.cache_dir)
        self.remote = RemoteCache.for_manager(self)  # cache_remote (S3): pulls, the "remote" verdict, push

        self._state_lock = threading.RLock()
        self._device_lock = Lane()  # the device lane: first come, first served; its holds give the idle fraction
        self._load_lock = threading.Lock()
        self._pipe: Any = None
        self._shape_free_warm = False
        self._loading = False
        self._load_s: float | None = None
        self._load_error: str | None = None
        self._graphs: dict[GraphKey, GraphState] = {}
        self._edits: dict[str, GraphKey] = {}  # edit label -> its graph, for status
        self._hits: dict[str, int] = {str(r): 0 for r in self.resolutions}
        self._observers = Observers()
        self._cache_size = FolderSize(settings.cache_dir)
        self.warmup = Warmup(self)
        self.admission = Admission()  # graceful shutdown: `drain` refuses new work, waits for work in flight
        self.safety = SafetyChecker(settings)  # classifies every image on the host CPU; loads on first use
        self.post = PostStage(post_workers(settings))  # the host work after the device (engine/output/postprocess.py)

    # --- identity --------------------------------------------------------------------------
    def _fingerprint_fields(self) -> dict[str, Any]:
        return fingerprint_fields(self)

    def graph_key(self, res: Resolution, references: Sequence[Resolution] = ()) -> GraphKey:
        # Where eager ops compile per shape (Neuron), the glue between the transformer and the decoder (latent
        # unpacking, de-normalisation, the tiler's slicing) runs at each resolution's own shape even with the
        # tiled VAE: a sibling of a token family is its own key, so `ready` means no compile of any kind.
        eager = self.backend.compiles_eager_ops_per_shape
        kwargs = {"max_sequence_length": self.settings.max_sequence_length, "references": tuple(references)}
        return GraphKey.for_shape(res, batch_size=BATCH_SIZE, per_orientation=eager, **kwargs)

    # --- observers ---------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` with every `GenerationRecord`, `CompileOutcome` and `RequestFailed`; returns unsubscribe."""
        return self._observers.subscribe(listener)

    def _emit(self, event: Any) -> None:
        self._observers.emit(event)

    # --- validation ------------------------------------------------------------------------------
    def offered_resolutions(self) -> list[str]:
        """Shapes the UI offers: all configured, or with `only_precompiled` those known to be compiled."""
        names = [str(r) for r in self.resolutions]
        if not self.settings.only_precompiled:
            return names
        status = self.status()
        return [n for n in names if status.shapes[n].offered]

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
        """Check a request against what the UI offers; raises `RequestError` with a clear message. `source`:
        `image`, `mask`, `strength` of an image-to-image or inpaint (engine/requests.py)."""
        options = {"lora": lora, "lora_scale": lora_scale, "references": references, **source}
        req = requests.validate(self.settings, self.offered_resolutions(), prompt, resolution, steps, seed, **options)
        if req.buckets and not self.settings.edits_compile_on_demand:  # no cold compile a caller picks (row 36)
            key = self.graph_key(req.resolution, req.buckets)

            def same(name: str) -> bool:  # labels that share the graph (the same token total on CPU)
                return (parsed := parse_label(name)) is not None and self.graph_key(*parsed) == key

            check_edit_compiled(self.settings, self.status().edits, req.resolution, req.buckets, same)
        return req

    # --- device work -------------------------------------------------------------------------------
    def _execute(self, call: PipelineCall, on_step: Callable[[int, int], None] | None = None) -> Any:
        """Run one pipeline call; in tensor-parallel mode every rank runs it in lockstep."""
        if self.lockstep is not None:
            self.lockstep.before(call)
        error: BaseException | None = None
        result = None
        try:
            result = self.device_step(call, on_step)
        except Exception as exc:
            error = exc
        if self.lockstep is not None:
            error = self.lockstep.after(error)
        if error is not None:
            raise error
        return result

    def device_step(self, call: PipelineCall, on_step: Callable[[int, int], None] | None = None) -> Any:
        """This rank's device work for one call: the LoRA style, the recompile room, the pipeline, then the device's
        errors (before the ranks agree). Rank 0 (`_execute`) and tensor-parallel followers (`follow`) run exactly
        this, so the ranks cannot drift apart."""
        try:
            with self.backend.device_work(), recompile_room(len(self.resolutions)):
                self.adapters.activate_all(call.loras)  # in place: the graph never changes
                result = run_call(
                    self._pipe,
                    call,
                    guidance_scale=self.settings.guidance_scale,
                    max_sequence_length=self.settings.max_sequence_length,
                    on_step=on_step,
                    prompt_cache=self.prompt_cache,
                )
        except Exception:
            self.backend.drain()  # a device error latched by this call must not fail the next one (N14)
            raise
        self.backend.synchronize()  # asynchronous device errors surface here, before the ranks agree
        return result

    @admitted
    def compile_shape(
        self, resolution: str | Resolution, progress: ProgressCallback | None = None, *, references: Sequence[Any] = ()
    ) -> CompileOutcome:
        """Make `resolution` ready (compiling it if needed): what precompile and warm-up call; with reference
        buckets, or an edit label ("64x64 + 1 ref (64x64)"), the edit graph."""
        res, buckets = requests.edit_target(self, resolution, references)
        self.ensure_loaded(progress)
        with self._device_lock:
            self.safety.prepare_device(self)  # `safety_device = "device"`: its graph compiles with the first shape
            return self._compile_locked(res, progress, buckets)

    def configured_resolution(self, resolution: str) -> Resolution:
        res = requests.parse_resolution(resolution)
        if res not in self.resolutions:
            raise RequestError(
                f"resolution {res} is not configured; configured: {', '.join(self.settings.resolutions)}",
                param="resolution",
            )
        return res

    @reports_failures
    @admitted
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
        """The raw-input entry (the Gradio API, MCP, the command line): `validate`, then `run`'s device work.
        `references` (bytes, paths or PIL images) make it an edit: each is snapped to its bucket first."""
        options = {"lora": lora, "lora_scale": lora_scale, "references": references, **source}
        req = self.validate(prompt, resolution, steps, seed, **options)
        return self._run(req, progress)

    @reports_failures
    @admitted
    def run(self, request: Request, progress: ProgressCallback | None = None) -> GenerationRecord:
        """Compile the request's shape if needed and generate: the device work of a request validated once at the
        edge (several images of one request share its decoded references). Same request, same image."""
        return self._run(request, progress)

    def _run(self, req: Request, progress: ProgressCallback | None) -> GenerationRecord:
        start = time.perf_counter()
        self.safety.refuse_if_failed()  # a checker that could not load: refused at once, before the model loads
        self.ensure_loaded(progress)
        self.safety.ready()  # its classifier loads before any device work: one that cannot load fails the request
        waiting = time.perf_counter()
        with tracing.span("queue"):  # while another request holds the device
            self._device_lock.acquire(req)
        try:
            held = time.perf_counter()
            eager_before = self.backend.eager_compile_count(self.counter.graphs)
            outcome = self._compile_locked(req.resolution, progress, req.buckets)

            # No picture of an unchecked image reaches anyone: no step previews while the safety checker is on.
            on_step = StepEvents(progress, str(req.resolution), previews=not self.safety.enabled,
                                 lockstep=self.lockstep is not None)  # fmt: skip
            t0 = time.perf_counter()
            try:
                image = self._execute(req.call(), on_step)
                on_step.raise_kept()
                switch_s = self.adapters.last_switch_s
            except Cancelled:
                log.info("generation %s cancelled at step %d of %d", req.resolution, on_step.last_step, req.steps)
                raise
            except Exception as exc:
                log.error("generation failed %s steps=%d: %s", req.resolution, req.steps, one_line(exc))
                if rule := rule_of(exc):
                    raise rule from exc
                raise GenerationFailed(f"generation failed: {one_line(exc)}") from exc
            safety = self.safety.check_on_device(image, self)  # device path: flagged raises before the lane is let go
            eager = self.backend.eager_compile_count(self.counter.graphs) - eager_before
            timings = {"start": start, "queue_s": held - waiting, "inference_s": time.perf_counter() - t0}
            timings["device_s"] = time.perf_counter() - held
            self._device_lock.busy(held, held + timings["device_s"], req, timings["inference_s"])
            self.post.take()  # a host slot for the image; all busy: the lane waits (backpressure)
        except BaseException:
            self._device_lock.release()
            raise
        if self.post.overlapped:  # the next request takes the device now; this one finishes on the host
            self._device_lock.release()
        try:
            with self.post.running_in_slot():  # safety, then marks and encode; a flagged image raises here
                record = finish(self, req, image, outcome, safety, eager=eager, switch_s=switch_s, **timings)
        finally:
            if not self.post.overlapped:  # in-line: the lane waited for the host work
                self._device_lock.release()
        fmt = "generate %s steps=%d cache=%s compile_s=%.2f inference_s=%.2f"
        log.info(fmt, record.resolution, record.steps, record.cache, record.compile_s, record.inference_s)
        self._emit(record)
        return record

    # --- warm-up and shutdown ----------------------------------------------------------------------
    def warmup_order(self) -> list[str]:
        return self.warmup.order()

    def start_warmup(self) -> threading.Thread | None:
        """Compile the warm-up shapes in a background thread; pages answer meanwhile (the safety checker too)."""
        self.safety.at_start()  # `on`: the classifier loads now; a failure shows in status before any click
        return self.warmup.start()

    def close(self) -> None:
        """Nothing to release in-process (the contract's `close` stops replicas)."""

    @property
    def supports_editing(self) -> bool:
        """Reference images are accepted unless editing is switched off (`max_references = 0`)."""
        return self.settings.max_references > 0

    # --- status --------------------------------------------------------------------------------
    def status(self) -> ManagerStatus:
        """A snapshot for the UI and the API; never waits for the device (engine/status_view.py)."""
        return build_status(self)


@functools.cache
def get_manager() -> PipelineManager:
    """The process-wide manager; tests call `get_manager.cache_clear()` to reset it."""
    return PipelineManager(get_settings())
