"""Cancel at the next step through the interfaces: DELETE on a running job (the job made with the `openai` SDK,
the DELETE in raw HTTP: the SDK has no jobs), and MCP's `cancel_job` tool (the `mcp` SDK). The manager's side, on
cpu and neuron-emulated, is tests/engine/test_cancel.py; the page's Stop is in tests/web/test_browser.py."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from openai import OpenAI

from tests.support import openai_client

#: Steps (the most max_steps allows): a job long enough to be caught running (a tiny 64x64 step is milliseconds).
LONG = 200


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(max_steps=LONG)


@pytest.fixture(scope="module")
def client(app: Any) -> OpenAI:
    return openai_client(app)


def job(app: Any, job_id: str) -> dict[str, Any]:
    return httpx.get(f"{app.url}v1/images/jobs/{job_id}", timeout=30).json()


def submit(client: OpenAI, steps: int) -> str:
    created = client.images.generate(
        prompt="a long job",
        size="64x64",
        extra_body={"num_inference_steps": steps, "seed": 3},
        extra_headers={"Prefer": "respond-async"},
    )
    return created.model_dump()["id"]


def running_at(app: Any, job_id: str, step: int) -> None:
    """Poll the job until it runs its `step`-th step (a backstop of 300 s)."""
    deadline = time.monotonic() + 300
    while (view := job(app, job_id)).get("progress", {}).get("step", 0) < step:
        assert view["status"] in ("queued", "running") and time.monotonic() < deadline, view
        time.sleep(0.01)


def test_delete_on_a_running_job_stops_it_at_the_next_step_and_the_next_request_needs_no_compile(
    app: Any, client: OpenAI
) -> None:
    app.manager.compile_shape("64x64")  # compiled now, by this test or one before it (the order is random)
    assert app.manager.status().shapes["64x64"].state == "ready"
    job_id = submit(client, LONG)
    running_at(app, job_id, 2)
    reply = httpx.delete(f"{app.url}v1/images/jobs/{job_id}", timeout=60)
    assert reply.status_code == 200
    answer = reply.json()
    assert answer["status"] == "cancelled" and answer["error"]["code"] == "cancelled", answer
    stopped = int(re.fullmatch(r"cancelled at step (\d+) of 200", answer["error"]["message"]).group(1))
    assert 2 < stopped < LONG and "data" not in answer
    assert not (app.settings.cache_dir / "job-images" / job_id).exists()  # its images were never stored
    assert job(app, job_id)["status"] == "cancelled"
    again = client.images.generate(prompt="next", size="64x64", extra_body={"num_inference_steps": 8})
    usage = again.model_dump()["usage"]
    assert usage["compile_s"] == 0 and usage["cache"] == "memory"  # the device is free, every graph kept
    metrics = httpx.get(app.url + "metrics", timeout=10).text
    assert re.search(r'^neuron_app_requests_total\{result="cancelled"\} [1-9]', metrics, re.M)


async def _mcp(url: str, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    async with (
        streamablehttp_client(url + "gradio_api/mcp/") as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return [await session.call_tool(name, args) for name, args in calls]


def test_mcps_cancel_job_tool_cancels_a_queued_job_and_names_an_unknown_one(app: Any, client: OpenAI) -> None:
    app.manager.ensure_loaded()  # first in a random order, the second job met "the model is loading" (503)
    with app.manager._device_lock:  # the device held (as by a long compile): the first job runs, the second waits
        first = submit(client, 1)
        second = submit(client, 1)
        cancelled, unknown = asyncio.run(
            _mcp(app.url, [("cancel_job", {"job_id": second}), ("cancel_job", {"job_id": "imgjob_" + "x" * 24})])
        )
    assert not cancelled.isError, cancelled.content
    assert json.loads(cancelled.content[0].text)["status"] == "cancelled"
    assert unknown.isError and "no job" in unknown.content[0].text
    deadline = time.monotonic() + 120
    while job(app, first)["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert job(app, first)["status"] == "succeeded" and job(app, second)["status"] == "cancelled"


def _usage(app: Any) -> tuple[float, float]:
    """The keyless caller's images made (from /metrics) and device seconds booked today (the usage book)."""
    import sqlite3

    metrics = httpx.get(app.url + "metrics", timeout=10).text
    found = re.search(r'^neuron_app_api_images_total\{key="\(none\)"\} ([0-9.]+)', metrics, re.M)
    with sqlite3.connect(app.settings.cache_dir / "usage.sqlite3") as db:
        row = db.execute("SELECT SUM(device_seconds) FROM usage WHERE key_name = '-'").fetchone()
    return float(found.group(1)) if found else 0.0, row[0] or 0.0


def test_a_job_cancelled_after_its_steps_began_is_booked_not_refunded(app: Any, client: OpenAI) -> None:
    """Row 32: a job cancelled near its end is no way around a limit: its image stays charged (what limits count)
    and the device time it took is booked in the usage table."""
    images, seconds = _usage(app)
    job_id = submit(client, LONG)
    running_at(app, job_id, 3)
    reply = httpx.delete(f"{app.url}v1/images/jobs/{job_id}", timeout=60)
    assert reply.json()["status"] == "cancelled", reply.text
    after_images, after_seconds = _usage(app)
    assert after_images == images + 1 and after_seconds > seconds
