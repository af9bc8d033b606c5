"""Webhook delivery under attack (web/jobs/webhooks.py, web/jobs/webhook_pool.py): a receiver that drips its answer is
cut off by the per-attempt deadline and the attempt retried, the pool stays bounded, and IPv6 forms that carry an IPv4
address (NAT64, 6to4, IPv4-compatible) are checked as that address; port 0 is refused.

The receivers are real loopback sockets; every wait is on an event, with a generous backstop.
"""

from __future__ import annotations

import base64
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from neuron_app.errors import RequestError
from neuron_app.web.jobs.webhook_pool import Deliveries
from neuron_app.web.jobs.webhooks import Allowlist

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


class Dripper:
    """A loopback receiver that reads the request, then sends a 200 answer one byte every `every_s` seconds.
    `cut[i]` is set when the client dropped connection i; `spans[i]` is how long it was held (seconds)."""

    def __init__(self, every_s: float = 3.0, answer: bool = True) -> None:
        self.every_s, self.answer = every_s, answer
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.cut: list[threading.Event] = []
        self.spans: list[float] = []
        self.release = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            event = threading.Event()
            self.cut.append(event)
            self.spans.append(0.0)
            threading.Thread(target=self._drip, args=(conn, event, len(self.spans) - 1), daemon=True).start()

    def _drip(self, conn: socket.socket, cut: threading.Event, index: int) -> None:
        start = time.monotonic()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            try:
                if not self.answer:  # hold the connection without a byte until released or dropped
                    conn.settimeout(0.2)
                    while not self.release.is_set():
                        try:
                            if conn.recv(1) == b"":
                                break
                        except TimeoutError:
                            continue
                else:
                    for byte in ANSWER:
                        conn.sendall(bytes([byte]))
                        if self.release.wait(self.every_s):
                            break
                    conn.sendall(b"")
                    conn.send(b"\0")  # after an RST this raises: the client is gone
            except OSError:
                pass
            self.spans[index] = time.monotonic() - start
            cut.set()

    def close(self) -> None:
        self.release.set()
        self.server.close()


@pytest.fixture
def dripper() -> Iterator[Dripper]:
    rec = Dripper()
    yield rec
    rec.close()


def test_a_dripping_receiver_is_cut_off_by_the_deadline_and_the_attempt_retried(dripper: Dripper) -> None:
    """One byte every 3 s (an answer of 38 bytes: about two minutes at that pace, 353 s in the issue's run with
    per-read timeouts): each attempt is dropped at the 4 s deadline, retried once, then recorded as failed."""
    pool = Deliveries(Allowlist(["127.0.0.1"]), workers=1, deadline_s=4.0, backoff_s=(0.5,))
    ended = threading.Event()
    records: list[dict[str, Any]] = []

    def done(record: dict[str, Any]) -> None:
        records.append(record)
        ended.set()

    try:
        assert pool.submit(dripper.url, SECRET, "msg_drip", b"{}", done)
        assert ended.wait(60), "the delivery never ended"
        record = records[0]
        assert record["delivered"] is False and record["attempts"] == 2 and record["status"] is None, record
        assert "no complete answer within 4 s" in record["last_error"]
        for cut in dripper.cut[:2]:  # the receiver saw each connection dropped, long before its answer ended
            assert cut.wait(30)
        assert len(dripper.cut) == 2 and max(dripper.spans) < 30, dripper.spans
        assert pool.pending == 0
    finally:
        pool.close()


def test_the_pool_is_bounded_and_a_retry_pause_holds_no_worker() -> None:
    """One worker and room for two: a third delivery is refused (its job records it failed); while the first
    waits out its retry pause, the second is attempted on the same worker; no thread per delivery."""
    holder = Dripper(answer=False)
    pool = Deliveries(Allowlist(["127.0.0.1"]), workers=1, max_pending=2, deadline_s=1.0, backoff_s=(60.0,))
    try:
        before = sum(t.name.startswith("webhook-") for t in threading.enumerate())  # other tests' pools too
        assert pool.submit(holder.url, SECRET, "msg_1", b"{}", lambda r: None)
        assert pool.submit(holder.url, SECRET, "msg_2", b"{}", lambda r: None)
        assert not pool.submit(holder.url, SECRET, "msg_3", b"{}", lambda r: None)
        for index in (0, 1):  # both first attempts ran (one worker, one after the other), each cut at 1 s
            deadline = time.monotonic() + 30
            while len(holder.cut) <= index and time.monotonic() < deadline:
                time.sleep(0.05)
            assert holder.cut[index].wait(30), f"attempt of delivery {index + 1} was never dropped"
        assert pool.pending == 2  # both wait out the 60 s pause in the queue, not in a thread
        webhook_threads = [t for t in threading.enumerate() if t.name.startswith("webhook-")]
        assert len(webhook_threads) <= 1 + before
    finally:
        pool.close()
        holder.close()


@pytest.mark.parametrize(
    "address",
    [
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b::a9fe:a9fe",  # NAT64 of the metadata service
        "64:ff9b:1::a00:1",  # local-use NAT64 of 10.0.0.1
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
        "2002:a9fe:a9fe::",  # 6to4 of 169.254.169.254
        "::7f00:1",  # IPv4-compatible 127.0.0.1
        "::a9fe:a9fe",  # IPv4-compatible 169.254.169.254
        "::ffff:0:a9fe:a9fe",  # SIIT's IPv4-translated 169.254.169.254 (issue 45, row 14)
    ],
)
def test_ipv6_forms_that_carry_an_ipv4_address_are_checked_as_that_address(address: str) -> None:
    allow = Allowlist(
        ["hooks.example.com", "64:ff9b::/32", "2002::/16", "::/96", "::ffff:0:0:0/96"], lambda h, p: [address]
    )
    with pytest.raises(RequestError) as caught:
        allow.check("https://hooks.example.com/x")  # a listed name that resolves there
    assert caught.value.param == "webhook_url" and ("non-public" in str(caught.value) or "link-local" in str(caught))
    with pytest.raises(RequestError):
        allow.check(f"http://[{address}]/x")  # the literal too, even inside a listed IPv6 network


def test_a_public_embedded_address_passes_and_port_0_is_refused() -> None:
    allow = Allowlist(["hooks.example.com", "127.0.0.1"], lambda h, p: ["64:ff9b::5db8:d70e"])  # 93.184.215.14
    assert allow.check("https://hooks.example.com/x").connect_url() == "https://[64:ff9b::5db8:d70e]:443/x"
    for url in ("http://127.0.0.1:0/hook", "https://hooks.example.com:0/x"):
        with pytest.raises(RequestError, match="port 0"):
            allow.check(url)


@pytest.mark.parametrize(
    "address",
    [
        "100.100.100.200",
        "169.254.169.254",
        "169.254.170.23",
        "168.63.129.16",
        "fd00:ec2::254",
        "::ffff:100.100.100.200",
    ],
)
def test_every_clouds_metadata_address_is_refused_even_inside_a_listed_network(address: str) -> None:
    """Row 46: with `webhook_hosts = ["100.64.0.0/10"]` (or any list holding it), Alibaba Cloud's metadata service
    (100.100.100.200: neither global nor link-local) passed; checked in-process with a stub resolver, nothing sent."""
    allow = Allowlist(["hooks.example.com", "100.64.0.0/10", "168.63.0.0/16", "169.254.0.0/16", "fd00::/8",
                       "::ffff:0:0/96"],
                      lambda h, p: [address])  # fmt: skip
    for url in ("https://hooks.example.com/x", f"http://{'[' + address + ']' if ':' in address else address}/x"):
        with pytest.raises(RequestError, match="metadata"):
            allow.check(url)


def test_a_webhook_hosts_entry_wider_than_a_slash_8_is_refused_at_start() -> None:
    """Row 46: `0.0.0.0/0` let a caller choose any address the checks did not name; now one line at start."""
    from neuron_app.errors import SettingsError
    from neuron_app.settings import load_settings

    secret = "whsec_" + "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3"
    for wide in ("0.0.0.0/0", "100.0.0.0/7", "::/0", "2000::/3"):
        with pytest.raises(SettingsError, match="is wider than a /"):
            load_settings(model="tiny", webhook_hosts=[wide], webhook_secret=secret)
    assert load_settings(model="tiny", webhook_hosts=["10.0.0.0/8", "fd00::/32"], webhook_secret=secret).webhook_hosts
