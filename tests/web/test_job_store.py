"""The job store as stored state (web/jobs/job_store.py): a corrupt file does not stop the server, a clean stop leaves
nothing in the WAL, pruning runs in the background, and the per-key and image caps hold.

The server-level tests drive the real tiny app with the `openai` SDK (`max_retries=0`, so a 429 is seen as it
is); the caps on stored images are checked on the store itself, where the rows and files can be counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from neuron_app.web.jobs.job_store import Caps, JobStore
from tests.support import TINY_OVERRIDES, AppProcess, free_port, link_models, openai_client, wait_for

ALICE = f"sk-alice-{uuid.uuid4().hex}"
BOB = f"sk-bob-{uuid.uuid4().hex}"
CAROL = f"sk-carol-{uuid.uuid4().hex}"  # the stored-jobs attack: her store is full after it, so nobody else's is
ASYNC = {"Prefer": "respond-async"}
PROMPT = "a lighthouse at dawn"
JOB = {"seed": 1, "num_inference_steps": 1}


class Lines(logging.Handler):
    """The records of one logger, kept (a module fixture cannot use caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def corrupt_app(tmp_path_factory: pytest.TempPathFactory, shared_models: Path) -> Iterator[Any]:
    """The real app started on a cache folder whose jobs.sqlite3 and usage.sqlite3 were overwritten with random
    bytes (issue 45, row 40: the usage book stopped the start), with small job caps: two queued or running jobs
    per key, three stored."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings
    from neuron_app.web.server import build_app, launch

    cache_dir = link_models(tmp_path_factory.mktemp("appcache"), shared_models)
    garbage = os.urandom(64 * 1024)
    (cache_dir / "jobs.sqlite3").write_bytes(garbage)
    (cache_dir / "usage.sqlite3").write_bytes(garbage[::-1])
    lines = Lines()
    logger = logging.getLogger("neuron_app.web.jobs.sqlite_file")  # both stores open through it
    logger.addHandler(lines)
    keys = {"alice": {"key": ALICE, "images_per_minute": 3}, "bob": {"key": BOB}, "carol": {"key": CAROL}}
    overrides = {"cache_dir": cache_dir, "server_port": free_port(), "api_keys": keys}
    settings = load_settings(**(TINY_OVERRIDES | overrides | {"jobs_per_key": 2, "jobs_stored_per_key": 3}))
    try:
        app = build_app(settings, PipelineManager(settings))
    finally:
        logger.removeHandler(lines)
    launch(app, block=False)
    # Loaded and compiled before any test holds the device lock: the caps test, when it ran first, met "the model
    # is loading" (503) on its first job (the whole suite in a random order)
    app.manager.compile_shape("64x64")
    app.url = f"http://127.0.0.1:{settings.server_port}/"
    app.lines, app.garbage = lines.records, garbage
    yield app
    # A clean stop (`shutdown`, what SIGTERM runs) closes the store: the WAL is checkpointed into the database with
    # every job in it. Checked once the module's tests are done with the app, whatever order they ran in.
    from neuron_app.web.server import shutdown

    path = cache_dir / "jobs.sqlite3"
    per_key = "SELECT key_name, COUNT(*) FROM jobs GROUP BY key_name ORDER BY key_name"
    with contextlib.closing(sqlite3.connect(path)) as db:  # a reader sees what the WAL holds
        stored = db.execute(per_key).fetchall()
    assert shutdown(app, 30)
    wal = path.with_name("jobs.sqlite3-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    with contextlib.closing(sqlite3.connect(path)) as db:  # and the database itself has them
        assert db.execute(per_key).fetchall() == stored
    app.demo.close()


def test_a_corrupt_store_is_kept_aside_with_one_line_and_the_server_serves(corrupt_app: Any) -> None:
    cache_dir = corrupt_app.settings.cache_dir
    aside = list(cache_dir.glob("jobs.sqlite3.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == corrupt_app.garbage  # kept as it was, for a post-mortem
    (usage,) = cache_dir.glob("usage.sqlite3.corrupt-*")
    assert usage.read_bytes() == corrupt_app.garbage[::-1]
    levels = [r.levelno for r in corrupt_app.lines]
    assert levels == [logging.ERROR] * 2, [r.getMessage() for r in corrupt_app.lines]
    for line, kept in zip(corrupt_app.lines, (aside[0], usage), strict=True):  # one line per store, in this order
        message = line.getMessage()
        assert line.exc_info is None and "\n" not in message  # one line, no traceback
        assert "not a database" in message and kept.name in message and str(cache_dir) not in message
    job = openai_client(corrupt_app, BOB, timeout=120).images.with_raw_response.generate(
        prompt=PROMPT, size="64x64", extra_headers=ASYNC, extra_body=JOB
    )
    assert job.status_code == 202
    job_id = job.http_response.json()["id"]
    done = wait_for(lambda: _finished(corrupt_app, BOB, job_id), 300, "the job on the fresh store")
    assert done["status"] == "succeeded" and done["data"][0]["b64_json"]
    with sqlite3.connect(cache_dir / "usage.sqlite3") as db:  # booked in the fresh usage book
        assert db.execute("SELECT SUM(images) FROM usage WHERE key_name = 'bob'").fetchone()[0] >= 1


def test_a_key_over_its_job_caps_gets_429_jobs_full_and_its_charge_back(corrupt_app: Any) -> None:
    """Alice (3 images a minute): with the device held, two jobs wait; a third is a 429 jobs_full, and its image
    is not charged (a later request still fits). Carol submits and cancels: the fourth stored job is refused."""
    alice = openai_client(corrupt_app, ALICE, timeout=60)
    corrupt_app.manager.ensure_loaded()  # first in a random order, the second job would meet "the model is loading"
    with corrupt_app.manager._device_lock:
        first, second = (
            alice.images.with_raw_response.generate(prompt=PROMPT, size="64x64", extra_headers=ASYNC, extra_body=JOB)
            for _ in range(2)
        )
        assert first.status_code == second.status_code == 202
        with pytest.raises(openai.RateLimitError) as caught:
            alice.images.generate(prompt=PROMPT, size="64x64", extra_headers=ASYNC, extra_body=JOB)
        assert caught.value.code == "jobs_full" and "queued or running" in caught.value.message
        assert int(caught.value.response.headers["retry-after"]) >= 1
    for raw in (first, second):
        job_id = raw.http_response.json()["id"]
        done = wait_for(lambda job_id=job_id: _finished(corrupt_app, ALICE, job_id), 300, "alice's job")
        assert done["status"] == "succeeded"
    assert alice.images.generate(prompt=PROMPT, size="64x64", extra_body=JOB).data[0].b64_json  # 3rd image fits

    carol = httpx.Client(base_url=corrupt_app.url, headers={"Authorization": f"Bearer {CAROL}"} | ASYNC, timeout=60)
    with corrupt_app.manager._device_lock:
        for _ in range(3):
            job_id = carol.post("v1/images/generations", json={"prompt": PROMPT, "size": "64x64"} | JOB).json()["id"]
            carol.delete(f"v1/images/jobs/{job_id}")  # cancelled at once: the attack that grew the store
    assert _stored(corrupt_app, "carol") == 3
    with pytest.raises(openai.RateLimitError) as caught:
        openai_client(corrupt_app, CAROL).images.generate(prompt=PROMPT, size="64x64", extra_headers=ASYNC)
    assert caught.value.code == "jobs_full" and "holds 3 jobs" in caught.value.message


def test_the_pruner_deletes_in_the_background_and_keeps_images_under_their_caps(tmp_path: Path) -> None:
    """Expired jobs go after the TTL; above the image count or byte cap the oldest ended jobs go first, running
    ones never. Nothing is deleted until the pruner's thread runs (woken, as a finished job wakes it)."""
    files = tmp_path / "files"
    store = JobStore(tmp_path / "jobs.sqlite3", files, ttl_s=60, caps=Caps(max_images=4, max_bytes=10_000))
    now = time.time()
    rows = [("expired", now - 61, 1, 100), ("a", now - 50, 2, 100), ("b", now - 40, 2, 100),
            ("c", now - 30, 1, 100), ("running", None, 1, 100)]  # fmt: skip
    for job_id, finished, images, size in rows:
        store.insert({"id": job_id, "status": "succeeded" if finished else "running", "created": now - 100,
                      "finished": finished, "images": images, "bytes": size})  # fmt: skip
        (files / job_id).mkdir(parents=True)
    assert store.totals() == (7, 500)
    (files / "imgjob_orphan").mkdir()  # a folder no row names (its store was corrupt and kept aside)
    store.start_pruning(every_s=3600)  # its first round runs at once, after sweeping the orphans
    wait_for(lambda: not (files / "imgjob_orphan").exists(), 30, "the orphan sweep")
    wait_for(lambda: store.get("a") is None, 30, "the background prune")
    assert store.totals() == (4, 300) and not (files / "a").exists() and not (files / "expired").exists()
    assert store.get("b") and store.get("c") and store.get("running") and (files / "b").exists()
    store.insert({"id": "big", "status": "succeeded", "created": now, "finished": now, "images": 1, "bytes": 9_900})
    store.wake()
    wait_for(lambda: store.get("c") is None, 30, "the byte cap")  # b and c (oldest) go; big and running stay
    assert store.get("b") is None and store.get("big") and store.get("running") and store.totals() == (2, 10_000)
    store.close()


def test_a_clean_close_checkpoints_and_a_corrupt_file_is_refused_only_when_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Close: no `-wal` data; a sound store reopens with its jobs (and no line); a truncated one is kept aside."""
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path, tmp_path / "files", ttl_s=60)
    for i in range(50):
        store.insert({"id": f"job{i}", "status": "succeeded", "created": time.time(), "result": "x" * 2000})
    assert path.with_name("jobs.sqlite3-wal").stat().st_size > 0
    store.close()
    assert not path.with_name("jobs.sqlite3-wal").exists()
    with caplog.at_level(logging.WARNING, logger="neuron_app.web.jobs.job_store"):
        again = JobStore(path, tmp_path / "files", ttl_s=60)
        assert again.get("job49") is not None
        again.close()
        assert caplog.records == []
        size = path.stat().st_size
        with path.open("r+b") as handle:  # a valid header, damaged pages: only the integrity check sees it
            handle.seek(4096)
            handle.write(os.urandom(size - 8192))
        fresh = JobStore(path, tmp_path / "files", ttl_s=60)
    assert fresh.get("job49") is None and len(list(tmp_path.glob("jobs.sqlite3.corrupt-*"))) == 1
    assert len(caplog.records) == 1 and "kept aside" in caplog.records[0].getMessage()
    fresh.close()


def _finished(app: Any, key: str, job_id: str) -> dict[str, Any] | None:
    view = httpx.get(app.url + f"v1/images/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert view.status_code == 200, view.text
    return view.json() if view.json()["status"] in ("succeeded", "failed", "cancelled") else None


def _stored(app: Any, key_name: str) -> int:
    with sqlite3.connect(app.settings.cache_dir / "jobs.sqlite3") as db:
        return db.execute("SELECT COUNT(*) FROM jobs WHERE key_name = ?", (key_name,)).fetchone()[0]


def test_a_second_process_on_the_same_state_folder_is_refused_at_start_with_the_reason(
    run_app_py: Callable[..., AppProcess],
) -> None:
    """Row 41: a second `python app.py` on a running one's cache folder would mark its running jobs failed (and
    share SQLite's WAL across processes): it stops at start, exit 2, one line naming the setting that separates
    them; the first one keeps serving."""
    first = run_app_py()
    first.wait_up()
    second = run_app_py(cache_dir=str(first.cache_dir))
    assert second.proc.wait(timeout=300) == 2, second.output()[-2000:]
    out = second.output()
    assert "is in use by process" in out and "NEURON_APP_STATE_DIR" in out and "Traceback" not in out
    assert str(first.cache_dir) not in out
    assert httpx.get(first.url + "healthz", timeout=30).status_code == 200
