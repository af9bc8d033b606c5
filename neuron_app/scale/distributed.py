"""Tensor-parallel serving under `torchrun --nproc_per_node=N app.py`: one page, N ranks in lockstep.

With tensor parallelism every rank holds a shard of the transformer, so every rank must run
every pipeline call, in the same order, with the same arguments. Rank 0 alone serves Gradio;
before each device call its manager broadcasts the call (`PipelineCall`) to the followers,
all ranks run it, and after it all ranks exchange their error (or None), so an error on any
rank is raised on rank 0 and nobody is left waiting in a collective. Commands travel on a
gloo group (plain CPU sockets, whatever the device backend), as pickled objects:

    ("call", PipelineCall)   run this call (followers skip the VAE decode: only rank 0 returns images)
    ("ping", None)           rank 0 is idle but alive: keeps followers' waits under the timeout
    ("shutdown", None)       leave the loop and exit 0 (rank 0 sends it on SIGTERM / SIGINT)

On Neuron, and on `neuron-emulated` (the tests), the transformer is loaded sharded over a
`DeviceMesh` with `TensorParallelConfig` (`backend.tp_mesh`); on plain `cpu` diffusers cannot
shard (no accelerator), so every rank runs the whole pipeline and only the protocol is exercised.

Its start-up checks are scale/tp_startup.py's; a TP group as one Ray replica is scale/group_rank.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from neuron_app.engine.model.runner import PipelineCall
from neuron_app.errors import LockstepError, one_line
from neuron_app.scale.tp_startup import check_loras_unsharded, check_tp_degree, settings_for_world, transformer_heads
from neuron_app.settings import Settings

log = logging.getLogger(__name__)

#: Longest a rank waits in one collective. Every rank compiles a new shape at the same time, so
#: waits are the difference between ranks (seconds), not a compile; a wedged rank fails the group then.
DIST_TIMEOUT_S = 1800.0
#: Rank 0 pings idle followers this often, so their wait for the next command never reaches the timeout.
HEARTBEAT_S = 30.0
#: After SIGTERM, the most rank 0 lets a running call finish before stopping the followers anyway
#: (`shutdown_grace_s` capped below torchrun's 30 s between its SIGTERM and SIGKILL).
SHUTDOWN_GRACE_S = 20.0

CALL, PING, SHUTDOWN = "call", "ping", "shutdown"
#: Rank 0's page, wired by app.py (scale/ never imports web/): starts serving `manager`, returns its stop, which
#: drains within the grace seconds given and closes the page (True when nothing was cut off).
Serve = Callable[[Any], Callable[[float], bool]]


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> RankInfo:
        """What torchrun sets for each process it starts."""
        return cls(
            int(os.environ.get("RANK", "0")),
            int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")),
        )


def describe_call(call: PipelineCall) -> str:
    """How a call appears in the logs: the shape and numbers, never the prompt."""
    style = (" lora=" + "+".join(f"{name} x{scale:g}" for name, scale in call.loras)) if call.loras else ""
    return f"{call.width}x{call.height} steps={call.steps} seed={call.seed}{style}"


# --- the protocol -------------------------------------------------------------------------------------
class Lockstep:
    """Both sides of the protocol over one process group; the manager sees `before`, `after` and `mesh`."""

    def __init__(self, rank: int, world_size: int, group: Any = None, mesh: Any = None) -> None:
        self.rank, self.world_size, self.group, self.mesh = rank, world_size, group, mesh
        #: Why the group can no longer be used (a rank died or timed out); read by /readyz.
        self.broken: str | None = None
        self.closed = False
        # Held from `before` to `after` of a call, by a ping and by shutdown: one message at a time.
        self._busy = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # rank 0 ------------------------------------------------------------------------------------------
    def before(self, call: PipelineCall) -> None:
        """Rank 0, before its own run: send the call to every follower."""
        if not self.is_leader:
            raise LockstepError("followers replay rank 0's calls; they never start one")
        self._busy.acquire()
        try:
            if self.closed:
                raise LockstepError("the server is shutting down")
            log.info("rank 0: executing %s", describe_call(call))
            self._send((CALL, call))
        except BaseException:
            self._busy.release()
            raise

    def after(self, error: BaseException | None) -> BaseException | None:
        """Rank 0, after its own run: the error to raise, its own or a follower's (None when all succeeded)."""
        try:
            return self.agree(error)
        finally:
            self._busy.release()

    def start_heartbeat(self, interval_s: float = HEARTBEAT_S) -> None:
        def beat() -> None:
            while not self._stop.wait(interval_s):
                if not self._busy.acquire(blocking=False):
                    continue  # a call is running: the followers are busy with it, not waiting
                try:
                    if self.closed or self.broken:
                        return
                    self._send((PING, None))
                except LockstepError as exc:
                    log.error("rank 0: %s", exc)
                    return
                finally:
                    self._busy.release()

        self._heartbeat = threading.Thread(target=beat, name="lockstep-heartbeat", daemon=True)
        self._heartbeat.start()

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> bool:
        """Rank 0: tell the followers to exit; True when they were told."""
        self._stop.set()
        if not self._busy.acquire(timeout=grace_s):
            log.warning("rank 0: a call is still running after %.0f s; stopping without telling the followers", grace_s)
            self.closed = True
            return False
        try:
            self.closed = True
            if self.broken:
                return False
            self._send((SHUTDOWN, None))
            log.info("rank 0: told %d follower(s) to shut down", self.world_size - 1)
            return True
        except LockstepError as exc:
            log.warning("rank 0: %s", exc)
            return False
        finally:
            self._busy.release()

    def _send(self, message: tuple[str, Any]) -> None:
        if self.broken:
            raise LockstepError(f"tensor-parallel group is broken: {self.broken}")
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([message], src=0, group=self.group)
        except Exception as exc:
            self.broken = f"sending {message[0]!r} failed ({one_line(exc)})"
            raise LockstepError(f"tensor-parallel group is broken: {self.broken}") from exc

    # every rank --------------------------------------------------------------------------------------
    def agree(self, error: BaseException | None) -> BaseException | None:
        """All ranks exchange their outcome; any rank's error becomes everybody's."""
        import torch.distributed as dist

        mine = None if error is None else one_line(error)
        outcomes: list[str | None] = [None] * self.world_size
        try:
            dist.all_gather_object(outcomes, mine, group=self.group)
        except Exception as exc:
            self.broken = f"rank {self.rank} lost the group while agreeing on a call ({one_line(exc)})"
            return error or LockstepError(f"tensor-parallel group is broken: {self.broken}")
        if error is not None:
            return error
        for rank, outcome in enumerate(outcomes):
            if outcome is not None:
                if self.is_leader:
                    log.error("rank 0: rank %d failed the call: %s", rank, outcome)
                return LockstepError(f"rank {rank} failed: {outcome}")
        return None

    # followers ---------------------------------------------------------------------------------------
    def receive(self) -> tuple[str, Any]:
        """A follower's next command from rank 0 (raises when rank 0 is gone or the wait timed out)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def init_group(backend: Any, info: RankInfo, timeout_s: float = DIST_TIMEOUT_S, store: Any = None) -> Lockstep:
    """Join the process group (`backend.dist_backend`; `store`: rank 0's own rendezvous, else torchrun's env://),
    a gloo group for commands, and the TP mesh."""
    import torch
    import torch.distributed as dist

    if backend.name == "cuda":
        torch.cuda.set_device(info.local_rank)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend=backend.dist_backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend=backend.dist_backend, timeout=timeout, store=store, rank=info.rank, world_size=info.world_size
        )
    control = None if backend.dist_backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return Lockstep(info.rank, info.world_size, control, backend.tp_mesh(info.world_size))


# --- the two roles ------------------------------------------------------------------------------------
def follow(manager: Any, lockstep: Lockstep) -> int:
    """A follower's life: replay rank 0's calls until it says shut down; the exit code."""
    signalled: list[float] = []

    def note_signal(signum: int, _frame: Any) -> None:
        signalled.append(time.monotonic())  # rank 0 got it too (torchrun signals every rank): wait for its shutdown

    signal.signal(signal.SIGTERM, note_signal)
    signal.signal(signal.SIGINT, note_signal)
    log.info("rank %d: following rank 0", lockstep.rank)
    while True:
        try:
            kind, payload = lockstep.receive()
        except Exception as exc:
            log.error("rank %d: lost rank 0 (%s); exiting", lockstep.rank, one_line(exc))
            return 1
        if kind == SHUTDOWN:
            log.info("rank %d: shutdown from rank 0; exiting", lockstep.rank)
            return 0
        if kind == PING:
            if signalled and time.monotonic() - signalled[0] > SHUTDOWN_GRACE_S + 5:
                log.warning("rank %d: signalled, and still no shutdown from rank 0; exiting", lockstep.rank)
                return 1
            continue
        call: PipelineCall = payload
        log.info("rank %d: executing %s", lockstep.rank, describe_call(call))
        error: BaseException | None = None
        try:  # rank 0's own device step (engine/manager.py); only rank 0's image is returned
            manager.device_step(dataclasses.replace(call, output_type="latent"))
        except Exception as exc:
            error = exc
            log.error("rank %d: call %s failed: %s", lockstep.rank, describe_call(call), one_line(exc))
        lockstep.agree(error)


def lead(manager: Any, lockstep: Lockstep, serve: Serve) -> int:
    """Rank 0's life: serve the app (`serve`, from app.py) until SIGTERM / SIGINT, then shut the followers down."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    lockstep.start_heartbeat()
    close_page = serve(manager)
    manager.start_warmup()  # after the page is up, as in one process
    log.info("rank 0: serving on http://%s:%d", manager.settings.server_name, manager.settings.server_port)
    while not stop.wait(0.5):  # the main thread stays free for signal handlers
        pass
    # Like a single process: refuse new requests, let the running one finish (its call runs on every
    # rank), close the page; then release the followers. Capped below torchrun's SIGTERM-to-SIGKILL delay.
    grace_s = min(manager.settings.shutdown_grace_s, SHUTDOWN_GRACE_S)
    log.info("rank 0: stopping (grace %.0f s)", grace_s)
    drained = close_page(grace_s)
    told = lockstep.shutdown(grace_s=2.0)
    log.info("rank 0: stopped")
    return 0 if drained and told else 1


def configure_rank_logging(settings: Settings, info: RankInfo) -> None:
    """Every log line names its rank: the ranks of one torchrun share a terminal."""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [rank {info.rank}/{info.world_size}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def serve_distributed(serve: Serve, prepare_leader: Callable[[Settings], None] = lambda settings: None) -> int:
    """Entry point of every torchrun process (app.py calls it when WORLD_SIZE > 1, with its page: `serve`, and
    `prepare_leader`, rank 0's checks before anything loads); the exit code. The group is the topology's first
    copy: rank r takes core r of its block (scripts/launch-trn.sh chose the topology and exported it)."""
    info = RankInfo.from_env()
    settings = settings_for_world(info.world_size)
    configure_rank_logging(settings, info)
    log.info("rank %d of %d started (pid %d)", info.rank, info.world_size, os.getpid())
    settings = rank_settings(settings, info)
    check_tp_degree(info.world_size, transformer_heads(settings))
    if info.rank == 0:
        prepare_leader(settings)  # e.g. refuse an unprotected public link before loading anything
    manager, lockstep = join_group(settings, info)
    try:
        return lead(manager, lockstep, serve) if info.rank == 0 else follow(manager, lockstep)
    finally:
        leave(lockstep)


def rank_settings(settings: Settings, info: RankInfo, block: list[int] | None = None) -> Settings:
    """A rank's settings and environment, before torch touches the device: the topology (chosen by the launcher,
    else here from the settings as given), and this rank's one core of its block (NEURON_RT_VISIBLE_CORES, the
    group's NEURON_RT_ROOT_COMM_ID), exported by `prepare_process`."""
    from neuron_app.environment import prepare_process
    from neuron_app.scale import topology

    settings = topology.settle(settings)
    found = topology.of(settings)
    if found is not None and found.core_blocks:
        block = block or found.block(0)
        topology.apply_rank_env(block, info.local_rank)
        settings = settings.model_copy(update={"visible_cores": str(block[info.local_rank])})
    prepare_process(settings)  # before the tiny model, torch.distributed or TorchNeuron import torch
    return settings


def join_group(settings: Settings, info: RankInfo, store: Any = None) -> tuple[Any, Lockstep]:
    """Join the group and load: (this rank's manager, its lockstep). Every rank loads at start, in the same order
    (a sharded load may talk to the other ranks)."""
    from neuron_app.backends import resolve_backend
    from neuron_app.engine.manager import PipelineManager

    backend = resolve_backend(settings.device, settings.cache_dir, check_device=False)
    lockstep = init_group(backend, info, store=store)
    try:
        check_loras_unsharded(settings, lockstep.mesh)
        backend.check_device()  # TorchNeuron asserts its runtime is not started before init_process_group
        manager = PipelineManager(settings, lockstep=lockstep)
        start = time.perf_counter()
        manager.ensure_loaded()
        log.info("rank %d: pipeline ready in %.1fs", info.rank, time.perf_counter() - start)
    except BaseException:
        leave(lockstep)
        raise
    return manager, lockstep


def leave(lockstep: Lockstep) -> None:
    import torch.distributed as dist

    if lockstep.broken is None and dist.is_initialized():
        dist.destroy_process_group()
