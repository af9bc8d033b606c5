"""Compiling one graph: the manager's cold path, apart from loading and the request path (manager.py).

A shape's graph is made ready by running the serving step count at that shape once (on Neuron that also
compiles every eager op a real request meets); the outcome, its cache verdict (memory, disk, remote, miss)
and its eager compiles go into the graph's state, the manifest and the observers. Called with the device
lock held.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from neuron_app import tracing
from neuron_app.engine.cache.estimates import estimate, estimate_words
from neuron_app.engine.cache.manifest import ManifestEntry
from neuron_app.engine.compile.warmup import warm_shape_free_ops
from neuron_app.engine.model.runner import PipelineCall
from neuron_app.engine.modes.edit_graphs import blank_references, edit_label
from neuron_app.engine.records import (
    CacheResult,
    CompileOutcome,
    GraphState,
    ProgressCallback,
    ProgressEvent,
    ShapeState,
)
from neuron_app.errors import CompileFailed, one_line, rule_of
from neuron_app.shapes import Resolution

log = logging.getLogger(__name__)

WARMUP_PROMPT = "warm-up"
#: Image-to-image and inpaint share one warm-up call: a partial strength runs the source mix, the mask the blend.
WARMUP_STRENGTH = 0.75


def source_warmup_call(res: Resolution, steps: int) -> PipelineCall:
    """An inpaint at the shape (N10): where eager ops compile per shape (Neuron), the VAE encoder at full
    resolution, the source's noising and the per-step blend outside the mask are the ops an image-to-image or
    inpaint request adds to text-to-image; without this its first request at a `ready` shape compiled them."""
    from PIL import Image, ImageDraw

    source = Image.new("RGB", (res.width, res.height), (128, 128, 128))
    mask = Image.new("L", (res.width, res.height), 0)
    ImageDraw.Draw(mask).rectangle((0, 0, res.width // 2, res.height), fill=255)
    return PipelineCall(
        WARMUP_PROMPT, res.width, res.height, steps, 0, init_image=source, mask=mask, strength=WARMUP_STRENGTH
    )


class ShapeCompiler:
    """Mixed into PipelineManager, whose state (graphs, counters, backend, manifest, remote) it works on."""

    _graphs: dict[Any, GraphState]
    _shape_free_warm: bool

    def _compile_locked(
        self, res: Resolution, progress: ProgressCallback | None, buckets: tuple = ()
    ) -> CompileOutcome:
        key, name = self.graph_key(res, buckets), edit_label(res, buckets) if buckets else str(res)
        with self._state_lock:
            self._edits.update({name: key} if buckets else {})
            graph = self._graphs.setdefault(key, GraphState())
            if graph.state is ShapeState.READY:
                return CompileOutcome(name, CacheResult.MEMORY, False, 0.0, 0)
            graph.state, graph.error = ShapeState.COMPILING, None
        if progress:
            shape = None if buckets else self.status().shapes.get(name)  # its row: a shared graph's entry counts
            warm = self.counter.graphs > 0  # the one-time graphs are paid: a first compile overstates this one
            entries = self.manifest.entries()
            found = shape.estimate if shape is not None else estimate(entries, name, self.fingerprint, warm)
            words = estimate_words(None if found is None else found.seconds)
            if found is not None and found.kind == "load":  # precompiled: the graph comes from the cache folder
                msg = f"Loading {name}'s precompiled graph from the cache ({words}); later requests reuse it"
            else:
                msg = f"Compiling {name} for the first time ({words}) - minutes on Neuron; later requests reuse it"
            progress(ProgressEvent("compiling", str(res), message=msg, graph=name, estimate=found))
        log.info("compile start %s (%s)", name, key)
        span = tracing.start("compile", shape=name, graph_key=str(key))  # compiles are spans of their own
        self.remote.before_compile(name)  # a shape the manifest lacks: the remote may have it by now
        before, graphs_before = self.probe.snapshot(), self.counter.graphs
        start = time.perf_counter()
        eager_before = self.backend.eager_compile_count(graphs_before)
        fallback_before, attention_mark = self.backend.fallback_ops(), self.backend.attention_mark()
        needs_run = (
            self.settings.compile_mode != "eager" or self.backend.compiles_eager_ops_per_shape or self.vae_compiled
        )
        try:
            if needs_run:
                # The serving step count at the target shape compiles the transformer and, on Neuron, every
                # eager op a real request runs (scheduler ops included); `_execute` waits for the device.
                steps, blank = self.settings.default_steps, blank_references(buckets)
                with self.prompt_cache.not_a_user_prompt(), tracing.using(span):  # counters: what people asked for
                    self._execute(PipelineCall(WARMUP_PROMPT, res.width, res.height, steps, 0, references=blank))
                    if not buckets and self.backend.compiles_eager_ops_per_shape:
                        self._execute(source_warmup_call(res, steps))
                self._warm_shape_free_ops()
        except Exception as exc:
            with self._state_lock:
                graph.state, graph.error = ShapeState.FAILED, one_line(exc)
            log.error("compile failed %s after %.1fs: %s", name, time.perf_counter() - start, graph.error)
            tracing.end(span, error=graph.error)
            self._emit(CompileOutcome(name, CacheResult.MISS, False, time.perf_counter() - start, 0))
            if rule := rule_of(exc):
                raise rule from exc  # the message starts "neuron rule:", as the emulator worded it
            raise CompileFailed(f"compiling {name} failed: {graph.error}") from exc
        elapsed = time.perf_counter() - start
        graphs = self.counter.graphs - graphs_before
        eager = self.backend.eager_compile_count(self.counter.graphs) - eager_before
        fallen_back = self.backend.fallbacks_since(fallback_before)  # this warm-up's, each op once
        if graphs > 0 or eager > 0 or not needs_run or self.settings.compile_mode == "eager":
            cache = CacheResult(self.probe.judge(before, self.probe.snapshot()))
        else:
            cache = CacheResult.MEMORY  # nothing new was compiled: dynamo already had this graph
        cache = self.remote.verdict(name, cache)  # a disk hit on pulled artifacts is a remote one
        outcome = CompileOutcome(name, cache, graphs > 0 or eager > 0, elapsed, graphs, eager)
        tracing.end(span, cache=str(cache), graphs=graphs, eager_compiles=eager)
        with self._state_lock:
            graph.state, graph.compile_s, graph.graphs, graph.cache = ShapeState.READY, elapsed, graphs, cache
            graph.eager_compiles, graph.fallback_ops = eager, fallen_back
            graph.nki_attention = self._family_attention(key, self.backend.nki_attention_since(attention_mark))
            graph.compiled_as = name
            self._cache_size.invalidate()  # the compile wrote to the cache folder: measure it again
        log.info("compile done %s in %.2fs: %d graph(s), %d eager op(s), cache=%s", name, elapsed, graphs, eager, cache)
        if needs_run:
            fields = self.fingerprint_fields
            entry = ManifestEntry(name, self.fingerprint, fields, round(elapsed, 3), graphs, str(cache))
            self.manifest.record(dataclasses.replace(entry, first_in_process=graphs_before == 0))
        self._emit(outcome)
        return outcome

    def _family_attention(self, key: Any, compiled: bool | None) -> bool | None:
        """A shape whose warm-up compiled no transformer graph (its token family's was there) has that graph's
        NKI verdict; called with the state lock held."""
        if compiled is not None:
            return compiled
        family = dataclasses.replace(key, layout=None)
        found = (g.nki_attention for k, g in self._graphs.items() if dataclasses.replace(k, layout=None) == family)
        return next((v for v in found if v is not None), None)

    def _warm_shape_free_ops(self) -> None:
        """Once per process where eager ops compile per signature: what no shape's warm-up meets (warmup.py)."""
        if self._shape_free_warm or not self.backend.compiles_eager_ops_per_shape:
            return
        warm_shape_free_ops(self._pipe, self.backend, self.settings)
        self._shape_free_warm = True
