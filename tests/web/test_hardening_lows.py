"""Issue 52's Lows, each the red team's attack repeated over loopback against the launched tiny app: a 5,000-deep
`loras` string on every entry that reads one (row 48), and the blocked-term look-alike in negative squared Latin
letters (row 49), and the queue ETA from the run time per shape and steps (row 30: it said 3.1 s for a wait of
~19 s behind a 512x512 16-step request)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client

from neuron_app.web.queue_place import QueuePlace
from tests.support import PATIENT_HTTP, openai_client, png, source_image

LORAS = {"red": "tiny:1", "blue": "tiny:2"}
DEEP = "[" * 5000 + "]" * 5000  # the red team's `loras`: Python's JSON parser gives up (RecursionError)
CLEAR = "loras must be a JSON list"
LONG = 40  # steps of the long request in the ETA test


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    """64x64 compiled here, with the fixture's own budget: a test's request timeout covers its run, never a
    first-use compile (120 s once did not cover one on a busy host)."""
    app = launch_tiny(loras=LORAS, blocked_terms=["forbiddenword"], max_steps=LONG)
    app.manager.compile_shape("64x64")
    return app


async def _mcp_generate(url: str, args: dict[str, Any]) -> Any:
    async with (
        streamablehttp_client(url + "gradio_api/mcp/") as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return await session.call_tool("generate", args)


def test_a_5000_deep_loras_string_is_a_clear_400_on_every_entry(app: Any) -> None:
    """Row 48: gradio_client's `/generate`, the OpenAI API as JSON and as an edit's form field, and MCP's
    `generate` each answer the one-line reason, never a RecursionError."""
    with pytest.raises(AppError) as page:
        Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
            "a red circle", "64x64", 1, 1, "none", 1.0, DEEP, api_name="/generate"
        )
    assert CLEAR in str(page.value) and "Recursion" not in str(page.value)

    api = openai_client(app)
    with pytest.raises(openai.BadRequestError) as generated:
        api.images.generate(prompt="a red circle", size="64x64", extra_body={"loras": DEEP})
    assert generated.value.body["param"] == "loras" and CLEAR in generated.value.body["message"]

    form = {"prompt": "make it red", "size": "64x64", "loras": DEEP}
    files = {"image": ("r.png", png(source_image(64)), "image/png")}
    edit = httpx.post(app.url + "v1/images/edits", data=form, files=files, timeout=60)
    assert edit.status_code == 400 and edit.json()["error"]["param"] == "loras", edit.text
    assert CLEAR in edit.json()["error"]["message"]

    called = asyncio.run(
        _mcp_generate(app.url, {"prompt": "a red circle", "resolution": "64x64", "steps": 1, "seed": 1, "loras": DEEP})
    )
    text = " ".join(getattr(c, "text", "") for c in called.content)
    assert called.isError and "Recursion" not in text  # MCP's schema says an array: refused before Gradio
    assert "is not of type 'array'" in text or CLEAR in text, text[-300:]


@pytest.mark.parametrize(
    "prompt",
    [
        "\U0001f175\U0001f17e\U0001f181\U0001f171\U0001f178\U0001f173\U0001f173\U0001f174\U0001f17d\U0001f186"
        "\U0001f17e\U0001f181\U0001f173",  # negative squared Latin capitals (U+1F170..): the red team's new form
        "a \U0001f155\U0001f15e\U0001f161\U0001f151\U0001f158\U0001f153\U0001f153\U0001f154\U0001f15d\U0001f166"
        "\U0001f15e\U0001f161\U0001f153 cat",  # negative circled (U+1F150..)
        "\U0001f1eb\U0001f1f4\U0001f1f7\U0001f1e7\U0001f1ee\U0001f1e9\U0001f1e9\U0001f1ea\U0001f1f3\U0001f1fc"
        "\U0001f1f4\U0001f1f7\U0001f1e9",  # regional indicators (turn 5's documented miss)
        "\u24a1\u24aa\u24ad\u249d\u24a4\u249f\u249f\u24a0\u24a9\u24b2\u24aa\u24ad\u249f",  # parenthesized small letters
    ],
)
def test_blocked_term_look_alikes_in_letter_symbols_are_refused(app: Any, prompt: str) -> None:
    """Row 49: `/v1/images/generations` refuses the term spelled in letters drawn inside symbols."""
    reply = httpx.post(app.url + "v1/images/generations", json={"prompt": prompt, "size": "64x64"}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "content_policy_violation" and "forbiddenword" in reply.text


def test_letter_symbols_in_an_ordinary_prompt_pass(app: Any) -> None:
    """The mapping reads symbols as letters only for matching: a prompt with 🅰 (blood type A) is served."""
    reply = httpx.post(
        app.url + "v1/images/generations",
        json={"prompt": "a \U0001f170 sign on a red square", "size": "64x64", "num_inference_steps": 1},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text


def _eta_and_run(app: Any, size: str, steps: int) -> tuple[float, float]:
    """A request's own X-Queue-Eta-Seconds (idle: its own run; NaN before the device has timed a request), and
    the inference seconds it then took."""
    body = {"prompt": "a red circle", "size": size, "num_inference_steps": steps, "seed": 1}
    reply = httpx.post(app.url + "v1/images/generations", json=body, timeout=600)
    assert reply.status_code == 200, reply.text
    return float(reply.headers.get("x-queue-eta-seconds", "nan")), reply.json()["usage"]["inference_s"]


def test_the_eta_follows_the_requests_shape_and_steps(app: Any) -> None:
    """Row 30 over loopback: after short 64x64 runs and one long 128x128 run, a long 128x128 request's ETA is its
    shape's and steps' run (not the median of everything, which the short runs pull down), and a short 64x64
    request's is the short run's."""
    for _ in range(3):
        _eta_and_run(app, "64x64", 1)
    _eta_and_run(app, "128x128", LONG)  # compiles it, then one timed run
    _eta_and_run(app, "128x128", LONG)
    # Compared with what the lane recorded, not with a clock: the machine may be busy (no timed assertions).
    recorded = app.manager.status().stages["device"]["shape_s"]
    long_recorded, short_recorded = recorded["128x128"]["by_steps"][str(LONG)], recorded["64x64"]["by_steps"]["1"]
    long_eta, _ = _eta_and_run(app, "128x128", LONG)
    short_eta, _ = _eta_and_run(app, "64x64", 1)
    # Each ETA is its own shape's and steps' run (the header has one decimal). Which of the two runs is longer is
    # the machine's business: on a busy 2-core host a 1-step 64x64 run (text encoder, VAE) once took longer than
    # 40 tiny 128x128 steps, so the two are not compared with each other.
    for eta, own in ((long_eta, long_recorded), (short_eta, short_recorded)):
        assert 0.5 * own - 0.05 <= eta <= 2 * own + 0.05, (eta, own, recorded)


def test_the_eta_counts_what_the_request_on_the_device_has_left_and_scales_a_shape_never_run(app: Any) -> None:
    """Behind a request on the device (a 256x256 run of 16 steps at 0.5 s a step, 2 s in), one waiting request
    and its own 64x64 image: 6 s left + one request at the median + its own 4 steps; a shape never run (128x64)
    scaled by pixels from the nearest timed shape."""
    status = app.manager.status()
    shapes = {"256x256": {"per_step_s": 0.5, "by_steps": {"16": 8.0}}, "64x64": {"per_step_s": 0.1, "by_steps": {}}}
    device = {"served": 10, "median_s": 1.0, "shape_s": shapes}
    device |= {"current": {"resolution": "256x256", "steps": 16, "elapsed_s": 2.0}}
    now = dataclasses.replace(status, stages=status.stages | {"device": device}, shapes={})
    place = dataclasses.replace(QueuePlace.taken(now, 2, 1), resolution="64x64", steps=4)
    assert place.eta_s(now) == 6.0 + 1.0 + 0.4
    unseen = dataclasses.replace(QueuePlace.taken(now, 0, 1), resolution="128x64", steps=10)
    assert unseen.eta_s(now) == 2.0  # 64x64's 0.1 s a step x 2 (pixels) x 10 steps (nearer than 256x256)
    late = {"current": {"resolution": "256x256", "steps": 16, "elapsed_s": 30.0}}  # over its time: one more step
    overdue = dataclasses.replace(now, stages=now.stages | {"device": device | late})
    assert dataclasses.replace(QueuePlace.taken(overdue, 1, 1), resolution="64x64", steps=4).eta_s(overdue) == 0.9


# --- issue 57's Lows (red-team turn 7) ----------------------------------------------------------------------------

FORGED = "alice\n2026-12-06  admin  root  9999\x1b[2J\x1b]0;owned\x07\r"


@pytest.mark.parametrize(
    ("name", "value"), [("user", FORGED), ("safety_identifier", "bob\u202egnp.exe"), ("user", "\0")]
)
def test_a_user_with_control_or_bidi_characters_is_a_400_naming_it_on_every_entry(
    app: Any, name: str, value: str
) -> None:
    """Row 23: `user` / `safety_identifier` with escape codes, a newline, NUL or U+202E were booked as sent and
    printed raw by `usage --users`; now a 400 naming the field, from the JSON body, the edit form and a job."""
    served = app.manager.status().stages["device"]["served"]
    body = {"prompt": "a lamp", "size": "64x64", name: value}
    answers = [
        httpx.post(app.url + "v1/images/generations", json=body, timeout=60),
        httpx.post(app.url + "v1/images/generations", json=body, headers={"Prefer": "respond-async"}, timeout=60),
        httpx.post(
            app.url + "v1/images/edits",
            data={k: str(v) for k, v in body.items()},
            files={"image": ("i.png", png(source_image(64)), "image/png")},
            timeout=60,
        ),
    ]
    for answer in answers:
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == name, answer.text
        assert "control characters or bidirectional overrides" in error["message"]
    assert app.manager.status().stages["device"]["served"] == served  # nothing ran


def test_usage_users_prints_every_cell_escaped_and_no_user_apart(tmp_path: Any) -> None:
    """Row 23, the printing: rows booked before the check (or by an older version) with escape codes and a newline
    print as their escapes, one line each; `"-"` sent as a user is not the row of images with no user."""
    import sqlite3

    from neuron_app.web.jobs.usage_book import UsageBook
    from tests.support import run_cli, tiny_env

    UsageBook(tmp_path / "usage.sqlite3").close()
    with sqlite3.connect(tmp_path / "usage.sqlite3") as db:
        rows = [(FORGED, 1), ("-", 2), (None, 3)]
        day = "2026-12-06"
        db.executemany(
            "INSERT INTO images (created, day, key_name, user, resolution, steps, output_megapixels, device_seconds) "
            "VALUES (0, ?, '-', ?, '64x64', 1, 0.004, ?)",
            [(day, u, s) for u, s in rows],
        )
    out = run_cli(tiny_env(tmp_path), "usage", "--users", timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 + len(rows), out.stdout  # a header, its rule, one line per row: nothing forged
    assert not any(c in out.stdout for c in "\x1b\r\x07\0")
    assert "alice\\n2026-12-06  admin  root  9999\\x1b[2J" in out.stdout
    assert any('"-"' in line for line in lines) and any("(none)" in line for line in lines)


def test_no_refusal_of_the_file_route_names_a_server_folder(app: Any) -> None:
    """Row 27: `/gradio_api/file=` with an alias and a way out of its folder answered `File not allowed:
    <cache>/outputs/../usage.sqlite3`; its refusals now go through the alias rewrite like every other answer."""
    import socket

    cache = str(app.settings.cache_dir)
    for form in ("/@outputs/../usage.sqlite3", "/@cache/usage.sqlite3", "/@outputs/../../x", "/@uploads/../a"):
        with socket.create_connection(("127.0.0.1", app.settings.server_port), 60) as sock:
            sock.sendall(f"GET /gradio_api/file={form} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith((b"HTTP/1.1 403", b"HTTP/1.1 404")), answer[:300]
        assert cache.encode() not in answer and b"/tmp" not in answer, answer[-300:]


@pytest.mark.parametrize("token", ["t" * (3 << 20), {"a": 1}, 1.5, True])
def test_an_mcp_progress_token_that_is_not_a_short_string_or_an_integer_is_refused(app: Any, token: Any) -> None:
    """Row 29: a 3 MB progressToken was echoed in each of 19 notifications (59.8 MB out for 3 MB in); now a
    progressToken is a string of at most 256 characters or an integer, else a 400 in JSON-RPC's shape (-32602)."""
    message = {"jsonrpc": "2.0", "id": 7, "method": "tools/call"}
    message["params"] = {"name": "generate", "arguments": {"prompt": "x"}, "_meta": {"progressToken": token}}
    headers = {"Accept": "application/json, text/event-stream"}
    answer = httpx.post(app.url + "gradio_api/mcp/", json=message, headers=headers, timeout=60)
    assert answer.status_code == 400, answer.text[:300]
    assert answer.json()["error"]["code"] == -32602 and "progressToken" in answer.json()["error"]["message"]
    assert answer.json()["id"] == 7
