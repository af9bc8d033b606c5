"""Every place bounded for its whole life: answers and trailers too (issue 57: red-team turn 7, rows 33, 34, 35).

One launched tiny app with the red team's caps (`max_connections` 40, 8 per address), attacked over loopback with raw
sockets the way the report did: never-ending heartbeats from five addresses, slow readers of a large file, a slow-body
flood beside a steady upload, 64 MB of chunked trailers. The trailers are sent under both of uvicorn's HTTP parsers
(httptools in the launched app; h11 in a uvicorn server of this process with the same protocol and Guard). Every wait
is on the server's answer or a polled state; deadlines are settings made small here, and backstops.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from neuron_app.web.guard import Guard
from tests.support import SlowBodies, guard_of, http_status, wait_for

CAP, PER_ADDRESS = 40, 8
STREAMS, STREAMS_PER_ADDRESS = 24, 6
SEND_S = 15.0  # the write deadline: small, for a test to see it pass; past RATE_GRACE_S, to see a displacement first
BACKSTOP_S = 120.0
MB = 1 << 20


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(
        max_connections=CAP,
        max_connections_per_address=PER_ADDRESS,
        max_streams=STREAMS,
        max_streams_per_address=STREAMS_PER_ADDRESS,
        send_timeout_s=SEND_S,
        body_timeout_s=60.0,
    )


def connect(port: int, address: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(BACKSTOP_S)
    if rcvbuf is not None:  # before connect: the window the client offers
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything until the server closes (a reset counts as the close)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def answer_while_sending(sock: socket.socket, sender: Callable[[], None]) -> bytes:
    """The server's whole answer, read while `sender` (a thread) keeps writing: a server that answers early and
    closes must not wait for a body it will never read."""
    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    try:
        return read_to_close(sock)
    finally:
        sock.close()
        thread.join(BACKSTOP_S)


def test_never_ending_heartbeats_from_five_addresses_leave_a_sixth_answered(app: Any) -> None:
    """Row 34: 5 addresses x 8 never-ending `GET /gradio_api/heartbeat/zz` (each answered, then held open) against
    `max_connections` 40 / 8 per address. They are long-lived answers, counted apart: a sixth address, and each
    of the five, is answered at once; past `max_streams` the oldest of the address with the most is ended."""
    guard, port = guard_of(app), app.settings.server_port
    held: list[socket.socket] = []
    try:
        for i in range(5 * PER_ADDRESS):
            sock = connect(port, f"127.0.0.{110 + i % 5}")
            sock.sendall(b"GET /gradio_api/heartbeat/zz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert http_status(sock) == "200", "a heartbeat answered"
            held.append(sock)
        assert guard.in_progress == 0 and len(guard.streams) == STREAMS
        assert max(guard.streams_by_address.values()) <= STREAMS_PER_ADDRESS
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.116"), timeout=BACKSTOP_S) as sixth:
            for route in ("", "v1/models"):
                assert sixth.get(app.url + route).status_code == 200, route
            assert "ready" in sixth.get(app.url + "readyz").json()
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.110"), timeout=BACKSTOP_S) as first:
            assert first.get(app.url + "v1/models").status_code == 200  # its own heartbeats hold no request place
        ended: set[int] = set()

        def count_ended() -> int:
            ended.update(i for i, sock in enumerate(held) if i not in ended and closed(sock))
            return len(ended)

        displaced = 5 * PER_ADDRESS - STREAMS  # closed by the server, not left hanging
        wait_for(lambda: count_ended() >= displaced, BACKSTOP_S, "the displaced heartbeats closed")
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: not guard.streams, BACKSTOP_S, "every heartbeat's place given back")


def closed(sock: socket.socket) -> bool:
    """Whether the server has ended this connection (what it has to read read now, then the end or a reset)."""
    try:
        while select.select([sock], [], [], 0)[0]:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    return False


def test_readyz_is_answered_whatever_the_request_cap(app: Any) -> None:
    """Row 34: /readyz has /healthz's exemption: with no place left it is answered, while /v1/models is a 503."""
    guard = guard_of(app)
    cap = guard.total_cap
    guard.total_cap = 0  # every place taken, none displaceable
    try:
        refused = httpx.get(app.url + "v1/models", timeout=BACKSTOP_S)
        assert refused.status_code == 503 and "requests in progress" in refused.text
        assert "ready" in httpx.get(app.url + "readyz", timeout=BACKSTOP_S).json()
    finally:
        guard.total_cap = cap


def largest_asset() -> tuple[str, int]:
    import gradio

    assets = Path(gradio.__file__).parent / "templates" / "frontend" / "assets"
    biggest = max(assets.glob("*.js"), key=lambda p: p.stat().st_size)
    return f"/assets/{biggest.name}", biggest.stat().st_size


def test_an_answer_the_client_does_not_read_is_closed_at_the_write_deadline(app: Any) -> None:
    """Row 34: slow readers of Gradio's largest asset (4.6 MB) held their places for as long as they liked; now the
    connection of an answer not read for `send_timeout_s` is closed and its place given back."""
    guard, (path, size) = guard_of(app), largest_asset()
    readers = [connect(app.settings.server_port, "127.0.0.120", rcvbuf=4096) for _ in range(3)]
    try:
        for sock in readers:  # three times, pipelined: more than the kernel's buffers take
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * 3)
        wait_for(lambda: guard.by_address.get("127.0.0.120") == len(readers), BACKSTOP_S, "the readers in progress")
        wait_for(lambda: "127.0.0.120" not in guard.by_address, BACKSTOP_S, "the unread answers closed")
        for sock in readers:
            assert len(read_to_close(sock)) < 3 * size  # cut before the answers were sent
    finally:
        for sock in readers:
            sock.close()


def test_slow_readers_at_the_cap_are_displaced_for_a_new_request(app: Any) -> None:
    """Row 34's slow readers, at the cap: 5 addresses x 8 readers of the 4.6 MB asset that read nothing hold every
    place; a sixth address is answered before the write deadline, taking the place of a stalled reader (its
    connection closed), not refused."""
    from neuron_app.web.guard import RATE_GRACE_S

    guard, (path, _size) = guard_of(app), largest_asset()
    readers = [connect(app.settings.server_port, f"127.0.0.{130 + i % 5}", rcvbuf=4096) for i in range(CAP)]
    try:
        for sock in readers:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * 3)

        def stalled() -> bool:
            now = time.monotonic()  # the server loop's clock (asyncio's and uvloop's are the monotonic one)
            return guard.in_progress == CAP and all(
                w.writing and now - w.write_since >= RATE_GRACE_S for w in guard.places.values()
            )

        wait_for(stalled, BACKSTOP_S, "every place held by a stalled reader")
        evicted = guard.evicted
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.136"), timeout=BACKSTOP_S) as sixth:
            assert sixth.get(app.url + "v1/models").status_code == 200
        assert guard.evicted == evicted + 1
    finally:
        for sock in readers:
            sock.close()
    wait_for(lambda: not guard.places, BACKSTOP_S, "the readers' places given back")


def paced(data: bytes, per_second: int) -> Iterator[bytes]:
    """`data` at about `per_second` bytes a second: a client's link speed (pacing the sender, not a measurement)."""
    step = per_second // 10
    for start in range(0, len(data), step):
        yield data[start : start + step]
        time.sleep(0.1)


def test_a_steady_upload_survives_a_slow_body_flood(app: Any) -> None:
    """Row 33: during a flood of slow bodies from 20 addresses at the cap, a 2 MB upload at 400 KB/s from another
    address completes (the displacement takes the slowest for its size, never a body that makes progress)."""
    guard, port = guard_of(app), app.settings.server_port
    flood = SlowBodies(port, CAP + 8, [f"127.0.1.{10 + i}" for i in range(20)])
    flood.thread.start()
    try:
        wait_for(lambda: guard.in_progress >= CAP and flood.opened > CAP + 4, BACKSTOP_S, "the server at its cap")
        boundary = b"b"
        head = b'--b\r\nContent-Disposition: form-data; name="files"; filename="r.bin"\r\n'
        head += b"Content-Type: application/octet-stream\r\n\r\n"
        body = head + bytes(2 * MB) + b"\r\n--b--\r\n"
        transport = httpx.HTTPTransport(local_address="127.0.0.121")
        with httpx.Client(transport=transport, timeout=BACKSTOP_S) as client:
            answer = client.post(
                app.url + "gradio_api/upload",
                content=paced(body, 400_000),
                headers={"Content-Type": f"multipart/form-data; boundary={boundary.decode()}",
                         "Content-Length": str(len(body))},
            )  # fmt: skip
        assert answer.status_code == 200, answer.text[:300]
        assert guard.evicted > 0  # the flood was displaced meanwhile
    finally:
        flood.stop.set()
        flood.thread.join(BACKSTOP_S)
    assert flood.answered["408"] > 0, flood.answered


#: The trailers' refusal: ours (431), or h11's own (400). A POST to /healthz may be answered (405) before they come.
REFUSED = (b"HTTP/1.1 431", b"HTTP/1.1 400")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def send_trailers(port: int, path: str, megabytes: int) -> tuple[bytes, int]:
    """Row 35's `trailers.py`: a chunked POST whose one chunk is a valid JSON body, then `0` and `megabytes` of
    `X-T: ttt...` trailer fields, then the final CRLF; what the server answered and how many bytes it took."""
    sock = connect(port, "127.0.0.122")
    sent = [0]

    def sender() -> None:
        body = b'{"prompt": "a red circle", "size": "64x64"}'
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        field = b"X-T: " + b"t" * 8000 + b"\r\n"
        with contextlib.suppress(OSError):
            sock.sendall(head.encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n")
            for _ in range(megabytes * MB // len(field)):
                sock.sendall(field)
                sent[0] += len(field)
            sock.sendall(b"\r\n")

    answer = answer_while_sending(sock, sender)
    return answer, sent[0]


@pytest.mark.parametrize("path", ["/healthz", "/v1/images/generations"])
def test_64_mb_of_trailers_are_refused_and_closed_under_httptools(app: Any, path: str) -> None:
    """Row 35, the launched app (httptools): the trailers count against `max_header_kb`; the request is refused
    (431) or, where its answer went out before them (a POST to /healthz: 405), its connection closed, before
    64 MB are read; the server's memory does not grow by them."""
    before = rss_mb()
    answer, sent = send_trailers(app.settings.server_port, path, 64)
    assert sent < 64 * MB - MB, "closed before the trailers ended"
    assert answer.startswith(REFUSED if path.startswith("/v1/") else (*REFUSED, b"HTTP/1.1 405")), answer[:200]
    assert rss_mb() - before < 32


@pytest.fixture
def h11_server(make_settings: Callable[..., Any]) -> Iterator[int]:
    """uvicorn on h11 in this process: the app's protocol subclass and Guard around a route that reads its body."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from neuron_app.web.guard import header_deadline
    from tests.support import free_port

    async def read(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})

    async def alive(request: Request) -> JSONResponse:
        return JSONResponse({"status": "alive"})

    settings = make_settings()
    inner = Starlette(routes=[Route("/v1/images/generations", read, methods=["POST"]), Route("/healthz", alive)])
    port = free_port()
    protocol = header_deadline(H11Protocol, 10.0, settings.max_header_kb << 10, 10.0)
    config = uvicorn.Config(Guard(inner, settings), host="127.0.0.1", port=port, http=protocol, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, BACKSTOP_S, "uvicorn started")
    yield port
    server.should_exit = True
    thread.join(BACKSTOP_S)


@pytest.mark.parametrize("path", ["/healthz", "/v1/images/generations"])
def test_64_mb_of_trailers_are_refused_and_closed_under_h11(h11_server: int, path: str) -> None:
    """Row 35 under h11 (the fallback without httptools): refused and closed before 64 MB are read, no growth."""
    before = rss_mb()
    answer, sent = send_trailers(h11_server, path, 64)
    assert sent < 64 * MB - MB
    assert answer.startswith(REFUSED if path.startswith("/v1/") else (*REFUSED, b"HTTP/1.1 405")), answer[:200]
    assert rss_mb() - before < 32


def test_a_body_left_unread_after_an_early_answer_is_drained_for_a_bounded_number_of_bytes(app: Any) -> None:
    """Row 35's second half: /healthz answers without reading a body; the rest was dropped for up to
    `header_timeout_s` whatever its size. Now the connection closes once DRAIN_BYTES are dropped."""
    from neuron_app.web.guard import DRAIN_BYTES

    sock = connect(app.settings.server_port, "127.0.0.123")
    sent = [0]

    def sender() -> None:
        with contextlib.suppress(OSError):
            sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n" % MB + bytes(MB) + b"\r\n"
            for _ in range(4 * DRAIN_BYTES // MB):
                sock.sendall(chunk)
                sent[0] += MB

    answer = answer_while_sending(sock, sender)
    assert answer.startswith(b"HTTP/1.1 405") and sent[0] < 3 * DRAIN_BYTES, sent[0]
