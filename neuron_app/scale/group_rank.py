"""A TP group as one Ray replica: rank 0 in the replica (`start_group`), ranks 1..N-1 its children, started as
`python -m neuron_app.scale.group_rank` with their environment set (their one core, the group's rendezvous) and the
replica's settings pickled on stdin (`main`, `follow_group`). The lockstep itself is scale/distributed.py's."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from typing import Any

from neuron_app.scale.distributed import Lockstep, RankInfo, configure_rank_logging, follow, join_group, leave
from neuron_app.settings import Settings

log = logging.getLogger(__name__)


def start_group(settings: Settings, block: list[int]) -> tuple[Any, Lockstep, list[Any]]:
    """Rank 0 of a TP group on `block`, in this process (a Ray replica): its own rendezvous store on a port the
    kernel picks (no probe to race), the other ranks started as children (`python -m neuron_app.scale.group_rank`,
    the settings on their stdin), each exporting its own core before torch; (manager, lockstep, children)."""
    import subprocess

    from neuron_app.scale import topology

    world = len(block)
    topology.apply_rank_env(block, 0)  # before torch: this process is rank 0, on the block's first core
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a group lives on one host: its control group on loopback
    settings = settings.model_copy(update={"visible_cores": str(block[0])})
    from neuron_app.environment import prepare_process

    prepare_process(settings)
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    children = []
    for rank in range(1, world):
        env = {
            **os.environ,
            **topology.rank_env(block, rank),
            **_rank_vars(rank, world),
            "MASTER_PORT": str(store.port),
        }
        command = [sys.executable, "-m", "neuron_app.scale.group_rank"]
        child = subprocess.Popen(command, stdin=subprocess.PIPE, env=env)
        child.stdin.write(pickle.dumps(settings.model_copy(update={"visible_cores": str(block[rank])})))
        child.stdin.close()
        children.append(child)
    os.environ.update(_rank_vars(0, world))
    manager, lockstep = join_group(settings, RankInfo(0, world, 0), store=store)
    lockstep.start_heartbeat()
    return manager, lockstep, children


def _rank_vars(rank: int, world: int) -> dict[str, str]:
    """What torchrun would set for a rank of a one-node group (TorchNeuron reads LOCAL_RANK, LOCAL_WORLD_SIZE)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
    }


def follow_group(settings: Settings) -> int:
    """A child rank of `start_group`: its environment is set; join, load, follow rank 0; dies with its parent."""
    info = RankInfo.from_env()
    configure_rank_logging(settings, info)
    _die_with_parent()
    from neuron_app.environment import prepare_process

    prepare_process(settings)
    import torch.distributed as dist

    # A client of rank 0's own store (not env://, which would prefix its keys "default_pg" where rank 0's do not).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size, is_master=False)
    manager, lockstep = join_group(settings, info, store=store)
    try:
        return follow(manager, lockstep)
    finally:
        leave(lockstep)


def _die_with_parent() -> None:
    """This rank exits as soon as its replica (rank 0, its parent) is gone, so a killed group leaves no rank holding
    a core: a watcher sees the parent change (the orphan is re-parented). Not PR_SET_PDEATHSIG, which fires when
    the parent's *thread* that started us ends (the replica starts its group on a worker thread)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        log.error("rank %s: its replica (pid %d) is gone; exiting", os.environ.get("RANK", "?"), parent)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> int:
    settings = pickle.loads(sys.stdin.buffer.read())
    return follow_group(settings)


if __name__ == "__main__":
    raise SystemExit(main())
