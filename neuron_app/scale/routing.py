"""The replicas' request router: a request waits a moment for a replica that holds its compiled graph.

Serve's default router (power of two choices, with multiplexing) sends a request to a replica without its graph as
soon as every holder looks busy. A holder looks busy for an instant after each answer: its count of ongoing requests
drops only after the result is on its way (Ray 2.58, `handle_request_with_rejection` yields the result inside the
counting block). So a client sending back-to-back requests alternated between two replicas (CI, stop 37), and each
request on a replica without the graph paid a load from disk, or a compile where no replica had one yet. Here the
holders alone are tried for `PATIENCE_S`; after that every replica is, holders first, so that a holder that stays
busy (a long generation, another shape's compile) does not hold the request up.

Ray imports this class by its path (`serve_app.ROUTER_CLASS`) in each process that routes: the front end, a proxy.
"""

from __future__ import annotations

import random
import time

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

PATIENCE_S = 1.0  # well past the instant a holder looks busy after an answer; far below a compile or a disk load


def _two(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Power of two choices within a rank: probe two at random, not all of a large cluster."""
    return random.sample(replicas, min(2, len(replicas)))


class GraphAffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        graph = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not graph:
            return [_two(candidate_replicas)] if candidate_replicas else []
        holders, *rest = self.rank_replicas_via_multiplex(candidate_replicas, graph)  # rank 0: the graph's holders
        if holders and pending_request is not None and time.time() - pending_request.created_at < PATIENCE_S:
            return [_two(holders)]  # none accepted: Serve asks again (with backoff) until the patience is spent
        return [_two(rank) for rank in (holders, *rest) if rank]
