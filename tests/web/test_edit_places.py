"""Issue 57, parts 3-5 (red team turn 7, rows 36, 4 and 47) on one launched tiny app that others "can reach" as far
as edits go (`edit_compile_on_demand = false`), with a small queue:

- row 36: after one edit graph at a shape, edits with 2 and 3 references at that shape compile nothing: they are
  refused in one line naming what is compiled (the `openai` SDK and gradio_client, as users send them);
- row 4: an edit holds its queue place from before its body to its answer, so concurrent edit bodies from many
  addresses are bounded by the queue (raw sockets, bodies promised and held back, as the report's curls were slow);
- row 47: 999 one-byte files in one upload are refused before Gradio writes them, and each file part is charged a
  block.

Every wait is on the server's answer; deadlines are backstops only.
"""

from __future__ import annotations

import dataclasses
import io
import os
import select
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from neuron_app.shapes import Resolution
from neuron_app.web.door.middleware import FILE_BLOCK, MAX_UPLOAD_FILES
from tests.support import http_answer

QUEUE = 2
BACKSTOP_S = 120.0
MB = 1 << 20
UPLOAD_MB_PER_MINUTE = 0.25
MULTIPART = "multipart/form-data; boundary=b"


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    launched = launch_tiny(
        queue_max_size=QUEUE, edit_compile_on_demand=False, upload_mb_per_minute=UPLOAD_MB_PER_MINUTE
    )
    launched.manager.ensure_loaded()
    return launched


def png(side: int, color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buf, "PNG")
    return buf.getvalue()


# --- row 36: no cold compile a caller picks ------------------------------------------------------------------


def test_edits_with_more_references_than_compiled_are_refused_in_one_line(app: Any, tmp_path: Path) -> None:
    """One edit graph compiled at 64x64 (as warm-up or `precompile --references 1` make it): an edit on it is
    served with no compile; 2 and 3 references are each refused in one line naming it, and compile nothing."""
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError
    from openai import BadRequestError, OpenAI

    from tests.support import PATIENT_HTTP

    app.manager.compile_shape("64x64", references=[Resolution(64, 64)])
    compiled = app.manager.status().compiles
    sdk = OpenAI(base_url=app.url + "v1", api_key="unused", timeout=BACKSTOP_S, max_retries=0)
    red, blue, green = png(64, (200, 30, 30)), png(64, (30, 30, 200)), png(64, (30, 200, 30))

    served = sdk.images.edit(image=red, prompt="make it blue", size="64x64", extra_body={"num_inference_steps": 1})
    assert served.data[0].b64_json and app.manager.status().compiles == compiled
    for images in ([red, blue], [red, blue, green]):
        with pytest.raises(BadRequestError) as refused:
            sdk.images.edit(image=images, prompt="mix them", size="64x64", extra_body={"num_inference_steps": 1})
        error = refused.value.body
        assert error["param"] == "image" and "\n" not in error["message"], error
        label = f"64x64 + {len(images)} refs (64x64, 64x64{', 64x64' if len(images) == 3 else ''})"
        assert error["message"] == (
            f"the edit graph {label} is not compiled on this server, and edits do not compile on demand here; "
            "compiled or precompiled: 64x64 + 1 ref (64x64)"
        )

    paths = []
    for i, data in enumerate((red, blue)):
        paths.append(tmp_path / f"ref{i}.png")
        paths[-1].write_bytes(data)
    client = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    with pytest.raises(AppError, match=r"the edit graph 64x64 \+ 2 refs \(64x64, 64x64\) is not compiled"):
        client.predict("mix them", [handle_file(p) for p in paths], "64x64", 1, 0, api_name="/edit")
    assert app.manager.status().compiles == compiled  # the counting backend saw no graph


def test_the_replicas_front_end_reads_the_replicas_edit_graphs(app: Any) -> None:
    """Through replicas, the front end checks an edit by the replicas' merged status: a graph one replica has
    compiled is served, one that none has is refused by the same line."""
    from neuron_app.engine.modes.edit_graphs import check_edit_compiled
    from neuron_app.errors import RequestError
    from neuron_app.scale.status_merge import merge_statuses

    one = [Resolution(64, 64)]
    app.manager.compile_shape("64x64", references=one)
    ready = app.manager.status()
    merged = merge_statuses(app.settings, [dataclasses.replace(ready, edits={}), ready], [])
    assert merged.edits["64x64 + 1 ref (64x64)"].state == "ready"
    check_edit_compiled(app.settings, merged.edits, Resolution(64, 64), one)
    with pytest.raises(RequestError, match=r"^the edit graph 64x64 \+ 2 refs \(64x64, 64x64\) is not compiled"):
        check_edit_compiled(app.settings, merged.edits, Resolution(64, 64), one * 2)


def test_compiling_edits_on_demand_is_the_operators_choice(make_settings: Callable[..., Any]) -> None:
    """Unset: on where no one else can reach the server (loopback), off where others can; the setting decides."""
    assert make_settings().edits_compile_on_demand
    assert not make_settings(server_name="0.0.0.0").edits_compile_on_demand
    assert not make_settings(behind_proxy=True).edits_compile_on_demand
    assert make_settings(server_name="0.0.0.0", edit_compile_on_demand=True).edits_compile_on_demand


# --- row 4: edit bodies bounded by the queue ---------------------------------------------------------------------


def connect(app: Any, address: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", app.settings.server_port), BACKSTOP_S, (address, 0))


def edit_head(length: int) -> bytes:
    lines = ["POST /v1/images/edits HTTP/1.1", "Host: x", f"Content-Type: {MULTIPART}", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_concurrent_edit_bodies_from_many_addresses_are_bounded_by_the_queue(app: Any) -> None:
    """Row 4 as sent (4 x 11 MB from 30 connections, then from two addresses), scaled down: edits promising
    1 MB from QUEUE + 4 addresses, each sending 1 KB and holding the rest. The queue's places (QUEUE waiting + one
    on the device) are held by the first bodies while they arrive; every other edit is a 429 `queue_full` before
    its body. Finished, the held ones are answered (400: not a valid form) and their places are free again."""
    room = QUEUE + app.settings.device_lanes
    socks = [connect(app, f"127.0.0.{110 + i}") for i in range(room + 4)]
    try:
        for sock in socks:
            sock.sendall(edit_head(MB) + b"--b\r\n" + b"x" * 1024)
        refused: list[socket.socket] = []
        while len(refused) < len(socks) - room:  # the 429s come at once; held bodies get no answer yet
            readable, _, _ = select.select([s for s in socks if s not in refused], [], [], BACKSTOP_S)
            assert readable, f"only {len(refused)} of {len(socks) - room} edits were refused: bodies not bounded"
            for sock in readable:
                head = http_answer(sock)
                assert head.startswith(b"HTTP/1.1 429") and b"queue_full" in head, head[:300]
                refused.append(sock)
        held = [s for s in socks if s not in refused]
        assert len(held) == room and not select.select(held, [], [], 0)[0]
        for sock in held:
            sock.sendall(b"x" * (MB - 1024 - 5))
            assert http_answer(sock).startswith(b"HTTP/1.1 400")  # read whole, then refused: its place goes with it
    finally:
        for sock in socks:
            sock.close()
    with connect(app, "127.0.0.120") as sock:  # every place is free again
        sock.sendall(edit_head(5) + b"--b\r\n")
        assert http_answer(sock).startswith(b"HTTP/1.1 400")


# --- row 47: disk charged by what it costs ------------------------------------------------------------------------


def upload_folder() -> Path:
    return Path(os.environ.get("GRADIO_TEMP_DIR") or Path(__import__("tempfile").gettempdir()) / "gradio")


def file_count() -> int:
    folder = upload_folder()
    return sum(len(files) for _, _, files in os.walk(folder)) if folder.exists() else 0


def test_999_one_byte_files_in_one_upload_are_refused_before_gradio_writes_them(app: Any) -> None:
    """Row 47 as sent: 999 one-byte files with distinct names in one upload: a 413 naming the cap; not one
    of them is kept. An upload of MAX_UPLOAD_FILES files (what the page sends at most) is taken."""
    before = file_count()
    many = [("files", (f"r0_{i}.png", b"x")) for i in range(999)]
    response = httpx.post(app.url + "gradio_api/upload", files=many, headers={"X-Forwarded-For": "203.0.113.47"},
                          timeout=BACKSTOP_S)  # fmt: skip
    assert response.status_code == 413, response.text
    assert response.json()["detail"] == f"an upload may carry at most {MAX_UPLOAD_FILES} files"
    assert file_count() == before
    few = [("files", (f"ok_{i}.png", b"y")) for i in range(MAX_UPLOAD_FILES)]
    taken = httpx.post(app.url + "gradio_api/upload", files=few, headers={"X-Forwarded-For": "203.0.113.48"},
                       timeout=BACKSTOP_S)  # fmt: skip
    assert taken.status_code == 200 and len(taken.json()) == MAX_UPLOAD_FILES, taken.text


def test_each_uploaded_file_is_charged_at_least_a_block(app: Any) -> None:
    """`upload_mb_per_minute = 0.25` (262,144 bytes): uploads of MAX_UPLOAD_FILES one-byte files are about 2.5 KB
    each on the wire, about a hundred a minute by their bytes; charged a block a file, the fourth is a 429."""
    budget = int(UPLOAD_MB_PER_MINUTE * MB)
    files = [("files", (f"b{i}.png", b"z")) for i in range(MAX_UPLOAD_FILES)]
    statuses = []
    while not statuses or statuses[-1] == 200:
        response = httpx.post(app.url + "gradio_api/upload", files=files, timeout=BACKSTOP_S,
                              headers={"X-Forwarded-For": "203.0.113.49"})  # fmt: skip
        statuses.append(response.status_code)
        assert len(statuses) <= budget // (MAX_UPLOAD_FILES * FILE_BLOCK) + 1, "files charged under a block each"
    assert statuses[-1] == 429 and len(statuses) - 1 == budget // (MAX_UPLOAD_FILES * FILE_BLOCK + 4096), statuses
