"""One budget for every way bytes reach the disk or memory (issue 45: red-team turn 5, rows 35-39).

A launched tiny app with small budgets, attacked over loopback with httpx and raw sockets as the report did: MCP
`data:` images, a "recording", large JSON bodies, an edit body from a key over its limit. Addresses come through
X-Forwarded-For, which uvicorn believes from 127.0.0.1 (FORWARDED_ALLOW_IPS), as from a proxy on the same host.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from neuron_app.web.door.aliases import upload_folder
from tests.support import http_answer

TIGHT_KEY = f"sk-tight-{uuid.uuid4().hex}"
BOB_KEY = f"sk-bob-{uuid.uuid4().hex}"
MB = 1 << 20
BACKSTOP_S = 120.0


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    os.environ["NEURON_APP_API_KEYS"] = json.dumps(
        {"tight": {"key": TIGHT_KEY, "images_per_minute": 1}, "bob": {"key": BOB_KEY}}
    )
    try:
        return launch_tiny(upload_mb_per_minute=8, upload_total_mb=12, request_body_mb=1)
    finally:
        os.environ.pop("NEURON_APP_API_KEYS", None)


def upload(app: Any, address: str, size: int) -> httpx.Response:
    files = {"files": ("blob.bin", os.urandom(size), "application/octet-stream")}
    return httpx.post(app.url + "gradio_api/upload", files=files, headers={"X-Forwarded-For": address}, timeout=60)


def kept(payload: bytes) -> list[Path]:
    """Files in Gradio's temp folder holding exactly `payload` (other tests may write there too)."""
    folder = Path(upload_folder())
    found = [p for p in folder.rglob("*") if p.is_file() and p.stat().st_size == len(payload)]
    return [p for p in found if p.read_bytes() == payload]


@pytest.fixture(scope="module")
def used_up(app: Any) -> None:
    """The hourly total (12 MB) taken by three addresses of 4 MB each."""
    for i in range(3):
        assert upload(app, f"198.51.100.{i + 1}", 4 * MB - 8192).status_code == 200  # the form's bytes, a block


def test_mcp_data_urls_are_charged_before_gradio_writes_them(app: Any, used_up: None) -> None:
    """Row 35: an MCP `edit` call with two 1.4 MB `data:` images while the upload space is used up is a 507 at the
    door, and neither image reaches Gradio's temp folder."""
    images = [os.urandom(1400 * 1024) for _ in range(2)]
    args = {"prompt": "x", "images": ["data:image/png;base64," + base64.b64encode(i).decode() for i in images]}
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "edit", "arguments": args}}
    headers = {"Accept": "application/json, text/event-stream", "X-Forwarded-For": "198.51.100.40"}
    answer = httpx.post(app.url + "gradio_api/mcp/", json=call, headers=headers, timeout=BACKSTOP_S)
    assert answer.status_code == 507, answer.text
    assert "the upload space (all addresses) is over its limit" in answer.json()["detail"]
    assert not any(kept(image) for image in images)


#: `data:` as JSON may spell it: letters and the colon as \\u escapes, the hex in either case, mixed.
DATA_SPELLINGS = [
    "data:",
    "\\u0064ata:",
    "d\\u0061ta:",
    "da\\u0074a:",
    "dat\\u0061:",
    "data\\u003a",
    "data\\u003A",
    "\\u0064\\u0061\\u0074\\u0061\\u003a",
    "\\u0064\\u0061\\u0074\\u0061\\u003A",
    "\\u0064a\\u0074a\\u003A",
    "DATA:",
    "\\u0044ata:",
]


@pytest.mark.parametrize("spelling", DATA_SPELLINGS)
def test_mcp_data_urls_are_charged_however_json_spells_them(app: Any, used_up: None, spelling: str) -> None:
    """Row 6: `\\u0064ata:` is `data:` once the JSON is parsed, and Gradio writes the file: every spelling is charged
    (a 507 with the hourly total used up) and none reaches Gradio's temp folder. The raw body is built by hand, so
    the escapes reach the server as sent."""
    image = os.urandom(96 * 1024)
    url = spelling + "image/png;base64," + base64.b64encode(image).decode()
    args = '{"prompt": "x", "images": ["' + url + '"]}'
    call = '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "edit", "arguments": ' + args + "}}"
    assert json.loads(call)["params"]["arguments"]["images"][0][:5].lower() == "data:"  # the same string, parsed
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    headers["X-Forwarded-For"] = "198.51.100.42"
    answer = httpx.post(app.url + "gradio_api/mcp/", content=call.encode(), headers=headers, timeout=BACKSTOP_S)
    assert answer.status_code == 507, answer.text
    assert not kept(image)


def test_a_recording_is_an_upload(app: Any, used_up: None) -> None:
    """Row 36: `/gradio_api/process_recording` (any multipart Gradio route) is charged like an upload."""
    video = os.urandom(2 * MB)
    answer = httpx.post(
        app.url + "gradio_api/process_recording",
        files={"video": ("clip.webm", video, "video/webm")},
        headers={"X-Forwarded-For": "198.51.100.41"},
        timeout=BACKSTOP_S,
    )
    assert answer.status_code == 507, answer.text
    assert not kept(video)


def test_gradio_bodies_over_request_body_mb_are_refused_as_they_arrive(app: Any) -> None:
    """Row 38: a 2 MB JSON body to `/gradio_api/call/generate` is a 413, declared or streamed (chunked)."""
    body = json.dumps({"data": ["a" * (2 * MB), "64x64", 1, 1]}).encode()
    declared = httpx.post(app.url + "gradio_api/call/generate", content=body, timeout=BACKSTOP_S)
    assert declared.status_code == 413, declared.text

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    streamed = httpx.post(app.url + "gradio_api/call/generate", content=chunks(), timeout=BACKSTOP_S)
    assert streamed.status_code == 413, streamed.text
    small = httpx.post(app.url + "gradio_api/call/generate", json={"data": ["a lamp", "64x64", 1, 1]}, timeout=60)
    assert small.status_code == 200 and "event_id" in small.json()


def test_an_edit_from_a_key_over_its_limit_is_refused_before_its_body(app: Any) -> None:
    """Row 39: with its minute's image spent, a key's edit that promises 40 MB and sends 1 KB of it gets its 429
    at once: the body is neither awaited nor parsed."""
    spent = httpx.post(
        app.url + "v1/images/generations",
        json={"prompt": "a lamp", "size": "64x64", "num_inference_steps": 1},
        headers={"Authorization": f"Bearer {TIGHT_KEY}"},
        timeout=BACKSTOP_S,
    )
    assert spent.status_code == 200, spent.text
    head = (
        "POST /v1/images/edits HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {TIGHT_KEY}\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        f"Content-Length: {40 * MB}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", app.settings.server_port), timeout=BACKSTOP_S) as sock:
        sock.sendall(head + b"--b\r\n" + b"x" * 1024)
        answer = http_answer(sock)
    assert answer.startswith(b"HTTP/1.1 429"), answer[:200]


def test_one_address_may_take_a_quarter_of_the_hourly_upload_space(make_settings: Callable[..., Any]) -> None:
    """Row 37: with 8 MB a minute and 40 MB an hour, one address gets 10 MB in the hour (its share), so it cannot
    keep everyone's uploads refused; another address still uploads. The door in front of a plain Starlette app,
    driven by httpx over ASGI, with the limiter's clock stepped past a minute."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from neuron_app.web.access import Limiter
    from neuron_app.web.door.middleware import Door

    async def take(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})

    now = [0.0]
    door = Door(
        Starlette(routes=[Route("/gradio_api/upload", take, methods=["POST"])]),
        make_settings(upload_mb_per_minute=8, upload_total_mb=40),
        Limiter(clock=lambda: now[0]),
    )

    async def send(address: str) -> int:
        transport = httpx.ASGITransport(app=door, client=(address, 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
            files = {"files": ("blob.bin", b"x" * (4 * MB - 8192), "application/octet-stream")}  # and a block
            return (await client.post("/gradio_api/upload", files=files)).status_code

    async def attack() -> list[int]:
        codes = [await send("192.0.2.1"), await send("192.0.2.1")]  # 8 MB in the first minute
        now[0] += 61
        codes += [await send("192.0.2.1"), await send("192.0.2.2")]  # the first over its 10 MB share of the hour
        return codes

    assert asyncio.run(attack()) == [200, 200, 429, 200]


def test_a_jobs_images_are_not_served_by_gradios_file_route(app: Any) -> None:
    """Row 12: a finished job's image is read with its key at `/v1/images/jobs/{id}`, and by no one through
    `/gradio_api/file=` (by its old alias, its real path, or the other file route)."""
    from tests.support import wait_for

    bob = {"Authorization": f"Bearer {BOB_KEY}"}
    body = {"prompt": "a secret lamp", "size": "64x64", "num_inference_steps": 1}
    created = httpx.post(
        app.url + "v1/images/generations", json=body, headers=bob | {"Prefer": "respond-async"}, timeout=60
    )
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    job_url = f"{app.url}v1/images/jobs/{job_id}"
    done = wait_for(lambda: (v := httpx.get(job_url, headers=bob, timeout=30).json())["status"] == "succeeded" and v,
                    BACKSTOP_S, "the job")  # fmt: skip
    assert done["data"][0]["b64_json"]
    real = app.settings.cache_dir / "job-images" / job_id / "0.png"
    assert real.is_file()
    for path in (
        f"/@outputs/jobs/{job_id}/0.png",
        str(real),
        str(app.settings.outputs_dir / "jobs" / job_id / "0.png"),
    ):
        for route in ("gradio_api/file=", "gradio_api/file/"):
            answer = httpx.get(app.url + route + path.lstrip("/" if route.endswith("/") else ""), timeout=30)
            assert answer.status_code in (403, 404), (route, path, answer.status_code)


def test_a_deeply_nested_mcp_message_is_a_400_not_a_500(app: Any) -> None:
    """Row 16: 200,000 nested brackets to the MCP endpoint were a 500 (the SDK's RecursionError); now a 400."""
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    answer = httpx.post(app.url + "gradio_api/mcp/", content=b"[" * 200_000, headers=headers, timeout=60)
    assert answer.status_code == 400 and "nested too deeply" in answer.json()["detail"]
