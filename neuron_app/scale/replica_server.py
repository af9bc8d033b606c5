"""The replica side of Ray Serve: one `PipelineManager` per replica, compiling each graph once per cluster.

Runs inside Ray's worker processes; `replicas.py` starts them and holds the manager-shaped client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

from neuron_app import tracing
from neuron_app.engine.records import (
    CompileOutcome,
    GenerationRecord,
)
from neuron_app.errors import RequestError, one_line
from neuron_app.settings import Settings

log = logging.getLogger(__name__)

#: The request field that carries the front end's trace context across the handle call (W3C headers).
TRACE_FIELD = "_trace"
#: How often a replica publishes its status, and when a silent one is forgotten.
PUBLISH_INTERVAL_S = 0.5
FORGET_AFTER_S = 60.0


def graph_ids(settings: Settings, per_orientation: bool) -> dict[str, str]:
    """Shape -> multiplexed id of its compiled graph: shapes that share a graph share an id (the first such shape)."""
    from neuron_app.shapes import GraphKey

    first: dict[GraphKey, str] = {}
    ids = {}
    for res in settings.parsed_resolutions:
        key = GraphKey.for_shape(
            res, batch_size=1, max_sequence_length=settings.max_sequence_length, per_orientation=per_orientation
        )
        ids[str(res)] = f"graph-{first.setdefault(key, str(res))}"
    return ids


def prepare_replica_environment(settings: Settings) -> None:
    """`prepare_process` in the replica's own worker: on a joined cluster (`ray start` on each node) the
    worker does not descend from the front end, so the fail-fast switches and the NEFF cache folder are
    exported here too (`runtime_env` carries the front end's values). The cores are the topology's block
    (`take_block`), not Ray's IDs nor the front end's `visible_cores`."""
    from neuron_app.environment import prepare_process

    prepare_process(settings.model_copy(update={"visible_cores": None}))
    tracing.setup(settings)  # the replica's spans join the front end's traces


def replica_cores(settings: Settings) -> int:
    """The cores one replica reserves (Ray's `neuron_cores`, GPUs): its topology block, whole (a TP group's other
    ranks are this replica's children, so one actor's reservation covers the group, on one node)."""
    from neuron_app.engine.model.real.layout import layout
    from neuron_app.scale.topology import of

    found = of(settings)
    if found is not None and found.core_blocks:
        return len(found.core_blocks[0])
    placement = found.placement if found is not None else settings.placement  # CUDA: no core numbers, its GPUs
    return settings.tp_degree if settings.tp_degree > 1 or placement == "auto" else layout(placement).cores


def take_block(settings: Settings) -> tuple[list[int], Any] | None:
    """The first block of the topology no other replica on this host holds: an exclusive lock file per block in the
    cache folder (host-named), which the kernel drops when the replica's process dies, so a replacement takes the
    block its killed predecessor held. (block, lock), or None where the topology has no blocks (CPU, CUDA)."""
    import socket

    from filelock import FileLock, Timeout

    from neuron_app.errors import DeviceUnavailable
    from neuron_app.scale.topology import of

    found = of(settings)
    if found is None or not found.core_blocks:
        return None
    folder = settings.cache_dir / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    for block in found.core_blocks:
        lock = FileLock(str(folder / f"cores-{host}-{block[0]}-{block[-1]}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        return block, lock
    raise DeviceUnavailable(
        f"every core block of the topology ({found.core_blocks}) is held by another replica on {host}: "
        "more replicas than the topology's copies"
    )


# --- the status board (a plain Ray actor) ----------------------------------------------------------------------
class StatusBoard:
    """Last status each replica published, with the board's clock: status never waits for a busy replica."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, dict[str, Any]]] = {}

    def put(self, replica_id: str, data: dict[str, Any]) -> None:
        self._entries[replica_id] = (time.time(), data)

    def snapshot(self) -> tuple[float, dict[str, tuple[float, dict[str, Any]]]]:
        now = time.time()
        for rid in [r for r, (stamp, _d) in self._entries.items() if now - stamp > FORGET_AFTER_S]:
            del self._entries[rid]
        return now, dict(self._entries)


# --- one replica -------------------------------------------------------------------------------------------------
class ReplicaServer:
    """The deployment body: one `PipelineManager`, loaded at start, one request at a time."""

    async def __init__(self, settings: Settings, board: Any) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context is not None else f"pid{os.getpid()}"
        # Loading off the event loop: Serve's health checks keep answering meanwhile.
        self.manager = await asyncio.to_thread(self._load, settings)
        self.board = board
        self.ids = graph_ids(settings, self.manager.backend.compiles_eager_ops_per_shape)
        self._first_of = {gid: shape for shape, gid in reversed(list(self.ids.items()))}
        self._fresh: dict[str, CompileOutcome] = {}  # graph id -> the compile its loading did, for the record
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_loop, name="status-publisher", daemon=True)
        self._publisher.start()

        async def load(graph_id: str) -> str:
            return await self._load_graph(graph_id)

        self._graph = serve.multiplexed(max_num_models_per_replica=len(self.ids) + 1)(load)
        self._warmup = asyncio.get_running_loop().create_task(self._warm())
        log.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    def _load(self, settings: Settings) -> Any:
        prepare_replica_environment(settings)  # first: nothing in this worker has imported torch yet
        taken = take_block(settings)
        self.block, self._block_lock = taken if taken else (None, None)
        self._ranks: list[Any] = []
        if self.block is not None and settings.tp_degree > 1:  # one TP group: rank 0 here, the others children
            from neuron_app.scale.group_rank import start_group

            manager, _lockstep, self._ranks = start_group(settings, self.block)
            return manager
        if self.block is not None:
            from neuron_app.scale.topology import apply_rank_env

            apply_rank_env(self.block, None)  # the block's cores, before torch touches the device
        from neuron_app.engine.manager import PipelineManager

        manager = PipelineManager(settings)
        if manager.backend.name in ("cpu", "neuron-emulated"):
            import torch

            torch.set_num_threads(settings.cores_per_replica)  # one model per core set: no oversubscription
        elif manager.backend.name == "neuron":
            import torch

            # Host work (CPU fallbacks, the safety checker, vae_device=cpu) shares the host's vCPUs between the
            # replicas instead of each taking all of them (second review, N12).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, settings.replicas)))
        manager.ensure_loaded()  # a bad model fails the replica's start with the manager's own message
        return manager

    # Serve's multiplexing calls this once per graph id on this replica, and tells the router it has it.
    async def _load_graph(self, graph_id: str) -> str:
        shape = self._first_of.get(graph_id)
        if shape is None:
            raise RequestError(f"unknown graph {graph_id!r}")
        outcome = await asyncio.to_thread(self._compile_once, shape)
        if outcome.compiled:
            self._fresh[graph_id] = outcome
        return graph_id

    def _compile_once(self, shape: str) -> CompileOutcome:
        """Compile once per cluster: the per-graph lock lets one replica compile; the others then load from disk."""
        from filelock import FileLock

        folder = self.manager.settings.cache_dir / "locks"
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / f"{self.manager.fingerprint}-{shape}.lock")):
            return self.manager.compile_shape(shape)

    async def _warm(self) -> None:
        """settings.warmup on this replica, through the multiplexer so that the router learns the graphs."""
        for shape in self.manager.warmup_order():
            try:
                await self._graph(self.ids[shape])
            except Exception as exc:  # a failed shape is marked failed in status; warm the others
                log.error("warm-up of %s failed: %s", shape, one_line(exc))
            self._fresh.pop(self.ids[shape], None)  # no request paid for this compile

    async def generate(self, fields: dict[str, Any]) -> GenerationRecord:
        """One request (`Request.portable()`): load (compile) its graph if this replica lacks it, then the manager's
        own `generate`, which validates it again with the same rules."""
        from ray import serve

        start = time.perf_counter()
        carrier = fields.pop(TRACE_FIELD, None)  # the front end's trace (tracing.inject): continued here
        with tracing.attached(carrier), tracing.span("replica.generate", replica=self.replica_id):
            graph_id = serve.get_multiplexed_model_id()
            if graph_id:
                await self._graph(graph_id)
            context = tracing.capture()
            record: GenerationRecord = await asyncio.to_thread(self._traced_generate, context, fields)
        fresh = self._fresh.pop(graph_id, None) if graph_id else None
        if fresh is not None:  # this request paid for the compile: say so, as the in-process manager would
            record = replace(
                record,
                cache=fresh.cache,
                compiled=True,
                compile_s=round(fresh.compile_s, 4),
                graphs_compiled=fresh.graphs,
                total_s=round(time.perf_counter() - start, 4),
                device_s=round(record.device_s + fresh.compile_s, 4),  # the compile held this replica's device
            )
        self._publish()  # the status board follows at once, not at the next tick
        return replace(record, replica=self.replica_id)

    def _traced_generate(self, context: Any, fields: dict[str, Any]) -> GenerationRecord:
        with tracing.resumed(context):
            return self.manager.generate(**fields)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.replica_id,
            "pid": os.getpid(),
            "cores": self.block,
            "in_flight": self.manager.in_flight,
            "graph_ids": self.ids,
            "status": self.manager.status(),
        }

    def _publish(self) -> None:
        try:
            self.board.put.remote(self.replica_id, self.describe())
        except Exception as exc:  # the board went away (the front end stopped): keep serving
            log.debug("status publish failed: %s", exc)

    def _publish_loop(self) -> None:
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            self._publish()

    async def check_health(self) -> None:
        """Serve calls this periodically; a replica whose publisher died is restarted."""
        if not self._publisher.is_alive():
            raise RuntimeError("status publisher stopped")

    def __del__(self) -> None:
        self._stop.set()


# --- the front end's client ------------------------------------------------------------------------------------
