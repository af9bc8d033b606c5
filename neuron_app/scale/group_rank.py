"""A TP group's rank 1..N-1 under a Ray replica (rank 0): `distributed.start_group` starts it with its environment
set (its one core, the group's rendezvous) and the replica's settings pickled on stdin."""

from __future__ import annotations

import pickle
import sys


def main() -> int:
    from neuron_app.scale.distributed import follow_group

    settings = pickle.loads(sys.stdin.buffer.read())
    return follow_group(settings)


if __name__ == "__main__":
    raise SystemExit(main())
