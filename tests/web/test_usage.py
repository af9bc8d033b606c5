"""Usage in every answer: the OpenAI API's `usage` (read with the official SDK), the job record's, the `info` and
the page's line; `/metrics` per shape and per key; `python -m neuron_app usage` from the usage table and the jobs."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from neuron_app.engine.records import CacheResult, GenerationRecord, Usage
from neuron_app.web.page.views import info_markdown
from tests.support import openai_client, run_cli, tiny_env, wait_for

KEY = f"sk-test-{uuid.uuid4().hex}"
FIELDS = {
    "queue_s",
    "compile_s",
    "inference_s",
    "steps",
    "output_megapixels",
    "input_megapixels",
    "cache",
    "eager_compiles",
    "device_seconds",
}


@pytest.fixture(scope="module")
def api_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(api_keys={"team-a": {"key": KEY}})


@pytest.fixture(scope="module")
def client(api_app: Any) -> OpenAI:
    return openai_client(api_app, key=KEY)


def usage_of(result: Any) -> dict[str, Any]:
    """The answer's `usage` as the SDK parsed it (its own Usage model keeps unknown fields)."""
    return result.usage.model_dump()


def test_compile_s_is_positive_exactly_when_the_request_compiled(client: OpenAI) -> None:
    cold = client.images.generate(prompt="a kite", size="128x64", extra_body={"seed": 1, "num_inference_steps": 3})
    usage = usage_of(cold)
    assert set(usage) >= FIELDS
    assert usage["compile_s"] > 0 and usage["cache"] in ("miss", "disk")
    assert usage["steps"] == 3 and usage["output_megapixels"] == 128 * 64 / 1e6 and usage["input_megapixels"] == 0
    assert usage["device_seconds"] >= usage["compile_s"] + usage["inference_s"] - 0.001
    warm = usage_of(client.images.generate(prompt="a kite", size="128x64", extra_body={"num_inference_steps": 2}))
    assert warm["compile_s"] == 0 and warm["cache"] == "memory" and warm["inference_s"] > 0
    assert warm["device_seconds"] >= warm["inference_s"]
    # n images: summed, and each image's provenance carries its own usage with the same fields
    two = client.images.generate(prompt="a kite", size="128x64", n=2, extra_body={"num_inference_steps": 2})
    assert usage_of(two)["steps"] == 4 and usage_of(two)["output_megapixels"] == 2 * 128 * 64 / 1e6
    for item in two.data:
        assert set(item.model_dump()["provenance"]["usage"]) == FIELDS


def finished_job(api_app: Any, client: OpenAI, steps: int) -> dict[str, Any]:
    """A 64x64 job sent through the SDK, and its view once it ended."""
    created = client.images.generate(
        prompt="a job",
        size="64x64",
        extra_body={"num_inference_steps": steps},
        extra_headers={"Prefer": "respond-async"},
    )
    job_id = created.model_dump()["id"]
    headers = {"Authorization": f"Bearer {KEY}"}

    def ended() -> dict[str, Any] | None:
        view = httpx.get(f"{api_app.url}v1/images/jobs/{job_id}", headers=headers, timeout=30).json()
        return view if view["status"] in ("succeeded", "failed") else None

    return wait_for(ended, 300, "the job's end")


def test_a_job_record_carries_usage_with_its_wait(api_app: Any, client: OpenAI) -> None:
    view = finished_job(api_app, client, 2)
    assert view["status"] == "succeeded", view
    assert set(view["usage"]) >= FIELDS and view["usage"]["queue_s"] >= 0 and view["usage"]["steps"] == 2


def test_metrics_have_per_shape_histograms_and_usage_per_key_today(api_app: Any, client: OpenAI) -> None:
    client.images.generate(prompt="metrics", size="64x64", extra_body={"num_inference_steps": 1})
    text = httpx.get(api_app.url + "metrics", timeout=10).text
    for name in ("queue_seconds", "device_seconds", "compile_seconds", "generation_seconds"):
        assert f'neuron_app_{name}_count{{shape="64x64"}}' in text, name
    today = time.strftime("%Y-%m-%d", time.gmtime())
    line = next(
        x
        for x in text.splitlines()
        if x.startswith(f'neuron_app_key_usage_today{{day="{today}",key="team-a",measure="images"}}')
    )
    assert float(line.split()[-1]) >= 1
    assert KEY not in text  # key names only


def test_the_usage_command_reads_the_table_and_the_jobs(api_app: Any, client: OpenAI) -> None:
    """Its own image and its own job (the book it reads is the module app's: other tests' rows only add)."""
    client.images.generate(prompt="counted", size="64x64", extra_body={"num_inference_steps": 1})
    assert finished_job(api_app, client, 1)["status"] == "succeeded"
    cache_dir = Path(api_app.settings.cache_dir)
    out = run_cli(tiny_env(cache_dir), "usage", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    (row,) = [r for r in json.loads(out.stdout) if r["key_name"] == "team-a"]
    assert row["images"] >= 2 and row["requests"] >= 1 and row["device_seconds"] > 0
    text = run_cli(tiny_env(cache_dir), "usage", "--days", "1", timeout=120).stdout
    assert "team-a" in text and "device_seconds" in text and "succeeded" in text  # the job, from the job store


def record(**fields: Any) -> GenerationRecord:
    base = {
        "resolution": "128x64",
        "steps": 4,
        "seed": 1,
        "prompt": "p",
        "cache": CacheResult.MEMORY,
        "compiled": False,
        "compile_s": 0.0,
        "inference_s": 0.5,
        "total_s": 0.6,
        "graphs_compiled": 0,
        "model": "tiny",
    }
    return GenerationRecord(**(base | fields))


def test_input_megapixels_count_references_at_their_buckets_and_a_masked_source_twice() -> None:
    refs = [{"size": "1000x1000", "bucket": "64x64", "sha256": "x"}, {"size": "9x9", "bucket": "128x64", "sha256": "y"}]
    assert Usage.of(record(references=refs)).input_megapixels == (64 * 64 + 128 * 64) / 1e6
    masked = Usage.of(record(source={"size": "300x300", "masked": True}))
    assert masked.input_megapixels == 2 * 128 * 64 / 1e6
    compiled = Usage.of(record(compiled=True, compile_s=0.0, cache=CacheResult.DISK))
    assert compiled.compile_s > 0  # compiled (here from the disk cache) in under the rounding: still > 0
    assert Usage.of(record(compile_s=3.0)).compile_s == 0  # no compile: nothing charged as one


def test_the_pages_info_line_carries_the_same_fields() -> None:
    shown = info_markdown(record(queue_s=0.25, device_s=0.5))
    short, details = shown.split("\n\n<details><summary>details</summary>\n\n")
    assert "usage" not in short and "safety" not in short and short.startswith("**cache: memory**")  # turn 7's T7-5
    (line,) = [part for part in details.split("\n\n") if part.startswith("usage: ")]  # one click away
    assert {part.split()[0] for part in line.removeprefix("usage: ").split(", ")} == FIELDS
    assert "queue_s 0.25" in line and "device_seconds 0.5" in line


def test_a_book_written_before_the_interface_column_is_carried_over_as_the_openai_apis(tmp_path: Path) -> None:
    """The usage table of an earlier version (the OpenAI API's alone, keyed by day and key): its rows are kept,
    booked to `openai`, and the page's images book beside them."""
    import sqlite3

    from neuron_app.web.jobs.usage_book import MEASURES, UsageBook

    path = tmp_path / "usage.sqlite3"
    old = sqlite3.connect(path)
    columns = ", ".join(f"{m} REAL NOT NULL DEFAULT 0" for m in MEASURES)
    old.execute(
        f"CREATE TABLE usage (day TEXT NOT NULL, key_name TEXT NOT NULL, {columns}, PRIMARY KEY (day, key_name))"
    )
    old.execute("INSERT INTO usage (day, key_name, requests, images) VALUES ('2026-12-01', 'team-a', 3, 5)")
    old.execute(
        "CREATE TABLE images (created REAL NOT NULL, day TEXT NOT NULL, key_name TEXT NOT NULL, user TEXT, "
        "resolution TEXT NOT NULL, steps INTEGER NOT NULL, output_megapixels REAL NOT NULL, "
        "device_seconds REAL NOT NULL)"
    )
    old.commit()
    old.close()
    book = UsageBook(path)
    try:
        book.book("page", [record(), record()])
        rows = {(r["key_name"], r["interface"]): r for r in book.rows()}
        assert rows[("team-a", "openai")]["images"] == 5 and rows[("team-a", "openai")]["requests"] == 3
        assert rows[("-", "page")]["images"] == 2 and rows[("-", "page")]["requests"] == 1
        assert [r["interface"] for r in book.images()] == ["page", "page"]
    finally:
        book.close()
