"""One policy for request bodies on every route the server answers (issue 52: red-team turn 6, rows 3, 7, 12, 38).

One launched tiny app with small caps and a short body deadline, attacked over loopback with raw sockets the way the
report did (slow bodies from many addresses, a promised body that never comes, a file to `/login`, huge headers,
edits that hold memory), scaled down for a 2-core machine. Every wait is on the server's answer or a polled state;
deadlines are backstops only.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from neuron_app.web.bodies import SMALLEST_BODY
from tests.support import ROOT, SlowBodies, guard_of, http_answer, wait_for

CAP, PER_ADDRESS, BODY_S = 16, 8, 20.0
ADDRESS_BODY_MB = 2
BACKSTOP_S = 120.0
MB = 1 << 20


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    launched = launch_tiny(
        max_connections=CAP,
        max_connections_per_address=PER_ADDRESS,
        body_timeout_s=BODY_S,
        header_timeout_s=BODY_S,
        address_body_mb=ADDRESS_BODY_MB,
    )
    launched.manager.ensure_loaded()
    return launched


def connect(app: Any, address: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", app.settings.server_port), BACKSTOP_S, (address, 0))


def post_head(path: str, length: int | None, *extra: str) -> bytes:
    kind = [] if any(line.startswith("Content-Type") for line in extra) else ["Content-Type: application/json"]
    lines = [f"POST {path} HTTP/1.1", "Host: x", *kind, *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer_and_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout of BACKSTOP_S fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def server_routes(app: Any) -> list[tuple[str, list[str]]]:
    """Every route of the launched server's Starlette app, mounts and included routers walked, paths filled in."""
    from fastapi.routing import _IncludedRouter
    from starlette.routing import Mount

    found: list[tuple[str, list[str]]] = []

    def walk(routes: list[Any], prefix: str) -> None:
        for route in routes:
            if isinstance(route, Mount):
                found.append((prefix + route.path + "/", ["POST"]))
                walk(route.routes, prefix + route.path)
            elif isinstance(route, _IncludedRouter):
                walk(route.original_router.routes, prefix + route.include_context.prefix)
            else:
                path = re.sub(r"\{[^}]*\}", "x", prefix + route.path)
                found.append((path, sorted(set(route.methods or ["GET"]) - {"HEAD"}) or ["GET"]))

    walk(app.demo.server_app.routes, "")
    return found


def door_table() -> list[str]:
    """The routes in docs/sharing.md's table of bodies (its first column, in backticks)."""
    text = (ROOT / "docs" / "sharing.md").read_text()
    table = text.split("### Every request body", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)`", table, re.M)]


def test_every_route_the_server_answers_has_a_body_cap_and_a_row_in_the_door_table(app: Any) -> None:
    """Item 2: the server's own route list after Gradio mounted everything: each route refuses a declared body one
    byte over its cap with a 413 before reading it, and docs/sharing.md's table names it (or its prefix), so a
    route added later cannot miss the door. A path no route knows gets the smallest cap."""
    guard, documented = guard_of(app), door_table()
    routes = [*server_routes(app), ("/no/such/route", ["POST"])]
    assert len(routes) > 40 and any(path == "/login" for path, _ in routes)
    from neuron_app.web.openai import forms
    from neuron_app.web.openai import routes as openai_routes

    assert guard.rules.cap("/v1/images/edits", {}) == forms.EDIT_BODY_LIMIT  # the door's copy of the routes' caps
    assert guard.rules.cap("/v1/images/generations", {}) == openai_routes.GENERATION_BODY_LIMIT
    for path, methods in routes:
        bare = path.rstrip("/") or "/"  # `/login/` is `/login`
        rows = [row for row in documented if bare == row or (row.endswith("*") and path.startswith(row[:-1]))]
        assert rows or path == "/no/such/route", f"{path} is not in docs/sharing.md's table of bodies"
        cap = guard.rules.cap(path, {"headers": []})
        if path == "/no/such/route":
            assert cap == SMALLEST_BODY
        with connect(app) as sock:
            head = post_head(path, cap + 1).replace(b"POST", methods[0].encode(), 1)
            sock.sendall(head)
            answer = http_answer(sock)
        assert answer.startswith(b"HTTP/1.1 413"), (path, methods, answer[:120])


def test_slow_bodies_from_many_addresses_neither_starve_others_nor_stay(app: Any) -> None:
    """Row 3: more slow bodies than `max_connections`, from four addresses, each under the per-address cap: the page,
    /readyz and /v1/models still answer 200 from a fifth address (a new request takes the place of the oldest
    body still arriving, which gets its 408), and the attacker's connections are answered and closed."""
    guard = guard_of(app)
    port = app.settings.server_port
    attack = SlowBodies(port, CAP + 8, [f"127.0.0.{40 + i}" for i in range(4)], most=40 * (CAP + 8))
    attack.thread.start()
    try:
        wait_for(lambda: guard.in_progress >= CAP and attack.opened > CAP + 4, BACKSTOP_S, "the server at its cap")
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.50"), timeout=BACKSTOP_S) as probe:
            for _ in range(3):
                for route in ("", "readyz", "v1/models"):
                    answer = probe.get(app.url + route)  # /readyz: 503 "ready": false until a shape is compiled
                    own = answer.status_code == 200 or (route == "readyz" and "ready" in answer.json())
                    assert own, (route, answer.status_code, answer.text[:200])
    finally:
        attack.stop.set()
        attack.thread.join(BACKSTOP_S)
    assert attack.answered["408"] > 0 and not attack.answered["503"], attack.answered


MULTIPART = "Content-Type: multipart/form-data; boundary=b"


PROMISED = ["/gradio_api/call/generate", "/login", "/v1/images/edits", "/gradio_api/upload", "/gradio_api/mcp/"]


def test_a_promised_body_that_never_comes_is_answered_408_and_closed_at_the_deadline(app: Any) -> None:
    """Row 3: `Content-Length: 99` and no body stayed open 300 s; now a 408 at `body_timeout_s`, then the close, on
    each kind of route (all sent at once: one deadline's wait)."""
    socks = [connect(app, "127.0.0.60") for _ in PROMISED]
    try:
        for sock, path in zip(socks, PROMISED, strict=True):
            sock.sendall(post_head(path, 99) if "call" in path or "mcp" in path else post_head(path, 99, MULTIPART))
        for sock, path in zip(socks, PROMISED, strict=True):
            answer = answer_and_close(sock)
            assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within" in answer, (path, answer[:200])
    finally:
        for sock in socks:
            sock.close()


def multipart_login(file_bytes: int) -> tuple[bytes, bytes]:
    head = b"--b\r\nContent-Disposition: form-data; name=username\r\n\r\nx\r\n"
    head += b"--b\r\nContent-Disposition: form-data; name=password\r\n\r\ny\r\n"
    head += b'--b\r\nContent-Disposition: form-data; name="f"; filename="f.bin"\r\n\r\n'
    return head, b"\0" * file_bytes + b"\r\n--b--\r\n"


def test_a_file_posted_to_login_is_refused_as_it_arrives(app: Any) -> None:
    """Row 7: a multipart file to `POST /login` (outside /gradio_api/) was spooled whole to the system temp folder;
    now a 413 before a byte is read when declared, and as soon as it passes the cap when streamed."""
    head, rest = multipart_login(2 * MB)
    headers = {"Content-Type": "multipart/form-data; boundary=b"}
    declared = httpx.post(app.url + "login", content=head + rest, headers=headers, timeout=BACKSTOP_S)
    assert declared.status_code == 413, declared.text

    def chunks() -> Iterator[bytes]:
        yield head
        for start in range(0, len(rest), 64 * 1024):
            yield rest[start : start + 64 * 1024]

    streamed = httpx.post(app.url + "login", content=chunks(), headers=headers, timeout=BACKSTOP_S)
    assert streamed.status_code == 413, streamed.text
    wrong = httpx.post(app.url + "login", data={"username": "x", "password": "y"}, timeout=BACKSTOP_S)
    assert wrong.status_code != 413  # a real login form is read as before


def test_headers_beyond_max_header_kb_are_a_431_and_the_connection_closed(app: Any) -> None:
    """Row 38: 100 MB of 1 KB headers were read whole and answered 200; now 431 once they pass `max_header_kb`."""
    with connect(app, "127.0.0.61") as sock:
        answer = send_headers(sock, 4 * app.settings.max_header_kb)  # 4 times the cap, unless closed first
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def send_headers(sock: socket.socket, kilobytes: int) -> bytes:
    """A GET of /healthz with `kilobytes` headers of 1 KB each, sent a header at a time; what the server answers."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    with contextlib.suppress(OSError):  # closed by the server while sending: its answer is still read
        for _ in range(kilobytes):
            sock.sendall(line)
        sock.sendall(b"\r\n")
    return answer_and_close(sock)


def test_one_address_cannot_hold_more_than_its_bytes_of_bodies_in_flight(app: Any) -> None:
    """Row 12: edits that promise `address_body_mb` between them hold that address's room: one more from it is a
    429 before a byte of its body is read; another address is served; the room comes back when a request ends."""
    size = ADDRESS_BODY_MB * MB // 2 + 1024  # two of them are over the address's room
    edit = "/v1/images/edits"
    first = connect(app, "127.0.0.70")
    try:
        first.sendall(post_head(edit, size, MULTIPART) + b"--b")
        guard = guard_of(app)
        wait_for(lambda: guard.body_bytes.get("127.0.0.70", 0) >= size, BACKSTOP_S, "the first edit in flight")
        with connect(app, "127.0.0.70") as second:
            second.sendall(post_head(edit, size))
            refused = http_answer(second)
        assert refused.startswith(b"HTTP/1.1 429") and b"bytes of request bodies in flight" in refused, refused
        with connect(app, "127.0.0.71") as other:  # another address: admitted, its route says what is wrong
            other.sendall(post_head(edit, size) + b"x" * size)
            answer = http_answer(other)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    finally:
        first.close()
    wait_for(lambda: "127.0.0.70" not in guard.body_bytes, BACKSTOP_S, "the first edit's bytes given back")
    with connect(app, "127.0.0.70") as again:
        again.sendall(post_head(edit, size) + b"x" * size)
        assert http_answer(again).startswith(b"HTTP/1.1 400")


def test_a_streamed_body_is_counted_as_it_arrives(app: Any) -> None:
    """Row 12, no declared length: chunked bytes count against the address's room as they arrive (a 429 once past)."""

    def chunks() -> Iterator[bytes]:  # a well-formed form whose one file goes on (the form streams as it comes)
        yield b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
        yield b"Content-Type: image/png\r\n\r\n"
        for _ in range(ADDRESS_BODY_MB * 2 + 1):
            yield b"x" * (MB // 2)

    # The edit route's own cap is 50 MB: only the address's room (2 MB) can stop this body.
    transport = httpx.HTTPTransport(local_address="127.0.0.72")
    with httpx.Client(transport=transport, timeout=BACKSTOP_S) as client:
        kind = {"Content-Type": "multipart/form-data; boundary=b"}
        answer = client.post(app.url + "v1/images/edits", content=chunks(), headers=kind)
    assert answer.status_code == 429 and "bytes of request bodies in flight" in answer.json()["error"]["message"]


def test_the_readme_install_brings_the_protocol_the_deadlines_rest_on(app: Any) -> None:
    """N7: the README's install (requirements.txt, through -r) and the Dockerfile's (requirements-common.txt)
    install httptools, and the launched server's protocol is the header deadline's subclass of it."""
    readme = (ROOT / "README.md").read_text()
    assert "pip install -r requirements.txt" in readme

    def requirements(name: str) -> list[str]:
        lines = [line.split("#", 1)[0].strip() for line in (ROOT / name).read_text().splitlines()]
        nested = [requirements(line[3:].strip()) for line in lines if line.startswith("-r ")]
        return [line for line in lines if line and not line.startswith("-r ")] + [r for n in nested for r in n]

    assert any(re.match(r"httptools\b", line) for line in requirements("requirements.txt"))
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert (
        "requirements-common.txt" in dockerfile
        and "requirements-common.txt" in (ROOT / "scripts" / "install-neuron.sh").read_text()
    )
    protocol = app.demo.server.config.http_protocol_class
    assert protocol.__name__ == "HeaderDeadlineHttpToolsProtocol"


def test_without_httptools_the_app_falls_back_to_its_own_deadline_on_h11(
    run_app_py: Callable[..., Any], tmp_path: Path
) -> None:
    """N7: `python app.py` where httptools cannot be imported serves on uvicorn's h11 protocol with the same header
    deadline and cap: half-sent headers are closed, huge headers are a 431, a normal request is answered."""
    blocker = tmp_path / "blocker" / "httptools"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('httptools is blocked for this test')\n")
    proc = run_app_py(env={"PYTHONPATH": str(blocker.parent)}, header_timeout_s=2.0, max_header_kb=8)
    proc.wait_up()
    wait_for(lambda: "Running on local URL" in proc.output(), BACKSTOP_S, "the start's last line")  # deadline set
    assert httpx.get(proc.url + "healthz", timeout=BACKSTOP_S).status_code == 200
    with socket.create_connection(("127.0.0.1", proc.port), BACKSTOP_S) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-a: b\r\n")
        assert answer_and_close(sock) == b""
    with socket.create_connection(("127.0.0.1", proc.port), BACKSTOP_S) as sock:
        assert send_headers(sock, 64).startswith(b"HTTP/1.1 431")  # ours at 8 KiB, before h11's own 16 KiB
    assert "httptools is not installed" not in proc.output()


def test_an_edit_meets_a_full_queue_before_its_body_is_read(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 12, admission first: with the queue full (Gradio's queue length, as the route reads it, held at its
    size), an edit that promises 1 MB and sends 1 KB of it gets its 429 `queue_full` at once, not after its body."""
    from neuron_app.web.openai import routes

    monkeypatch.setattr(routes, "gradio_queue_length", lambda demo: app.settings.queue_max_size + 8)
    with connect(app, "127.0.0.73") as sock:
        sock.sendall(post_head("/v1/images/edits", MB, MULTIPART) + b"--b\r\n" + b"x" * 1024)
        answer = http_answer(sock)
    assert answer.startswith(b"HTTP/1.1 429") and b"queue_full" in answer, answer[:300]
