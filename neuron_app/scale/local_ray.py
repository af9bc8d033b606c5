"""A local Ray instance started on a busy machine.

`ray.init(address="local")` waits a fixed 30 s for its raylet to register with the GCS (ray/_private/node.py:
`raylet_start_wait_time_s`, not a setting), then raises "The current node timed out during startup" and leaves the
processes it started (GCS, raylet, agents) running until this process exits. On a machine busy with other work
(two test suites side by side, a bench run's processes) those 30 s ran out for `python app.py` with replicas. A
start that ran out is made again from scratch, after ending what the failed one left.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: Ray's message when its raylet did not register in time.
TIMED_OUT = "timed out during startup"


def init_local(ray: Any, tries: int = 3, **kwargs: Any) -> Any:
    """`ray.init(address="local", **kwargs)`, made again up to `tries` times when Ray's own start-up wait ran out."""
    import psutil

    me = psutil.Process()
    for attempt in range(1, tries + 1):
        before = {child.pid for child in me.children(recursive=True)}
        try:
            return ray.init(address="local", **kwargs)
        except Exception as exc:
            if TIMED_OUT not in str(exc) or attempt == tries:
                raise
            ended = _end_new_children(me, before)
            ray.shutdown()
            log.warning(
                "Ray's local start ran out of its 30 s (a busy machine?): ended the %d processes it left, starting"
                " it again (try %d of %d)",
                ended,
                attempt + 1,
                tries,
            )
    raise AssertionError("unreachable")  # the loop returns or raises


def _end_new_children(me: Any, before: set[int]) -> int:
    """SIGKILL every process below this one that the failed start made; returns how many."""
    import psutil

    new = [child for child in me.children(recursive=True) if child.pid not in before]
    for child in new:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(new, timeout=30)
    return len(new)
