"""Webhooks of asynchronous jobs: which URLs may be called, Standard Webhooks signatures, bounded retries.

A webhook makes the server open a connection where a caller says: on AWS that is an SSRF door to the instance
metadata service (169.254.169.254) and the VPC. So a `webhook_url` must name a host listed in `webhook_hosts`,
and every address the host resolves to must be public or inside a listed network; link-local addresses (the
metadata service among them) never pass. The check runs at submit time (a 400 naming `webhook_url`, no
connection made) and again before every attempt, and the connection goes to the address that was checked (the
host name only in `Host` and TLS's SNI), so a DNS answer that changes in between (rebinding) is not followed.
Redirects are not followed either. IPv6 forms that carry an IPv4 address (mapped, NAT64, 6to4, IPv4-compatible)
are checked as that address, and port 0 is refused. Each attempt has a total deadline, connect to last byte
(per-read timeouts let a receiver that drips one byte every 3 s hold an attempt for minutes).

Signatures follow the Standard Webhooks spec (standardwebhooks.com): headers `webhook-id` (the same on every
attempt), `webhook-timestamp` and `webhook-signature` = `v1,` + base64 HMAC-SHA256 of `{id}.{timestamp}.{body}`
under the base64-decoded `whsec_` secret; any Standard Webhooks library verifies them.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from neuron_app.errors import RequestError, one_line

log = logging.getLogger(__name__)

#: Seconds before attempts 2, 3 and 4 (then the delivery is given up and recorded as failed).
BACKOFF_S = (1.0, 5.0, 25.0)
CONNECT_TIMEOUT_S = 5.0
#: The deadline of one attempt, from connect to the last byte read (the default of `webhook_timeout_s`).
TOTAL_TIMEOUT_S = 10.0
#: Bytes of a receiver's answer read at most: only its status is used.
ANSWER_BYTES = 64 * 1024
#: Never a target, even if listed: the cloud metadata services. AWS, GCP, Azure, Oracle, DigitalOcean and OpenStack
#: share the first; ECS task metadata; Alibaba Cloud's (in 100.64.0.0/10, neither global nor link-local: row 46);
#: AWS's IPv6 one; Azure's wire server and its IMDS on Azure Stack; Oracle's second.
METADATA = frozenset(
    ipaddress.ip_address(text)
    for text in (
        "169.254.169.254",
        "169.254.170.2",
        "169.254.170.23",
        "100.100.100.200",
        "fd00:ec2::254",
        "fd00:ec2::23",
        "168.63.129.16",
        "192.0.0.192",
    )
)

#: IPv6 prefixes whose last 32 bits are an IPv4 address that a translator connects to (RFC 6052, RFC 8215),
#: and the deprecated IPv4-compatible range (RFC 4291).
NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
COMPATIBLE = ipaddress.ip_network("::/96")
#: SIIT's IPv4-translated addresses (RFC 6052/7915, ::ffff:0:a.b.c.d): a translator connects to the IPv4 one.
TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]


def _refuse(message: str) -> RequestError:
    return RequestError(message, param="webhook_url", code="invalid_webhook_url")


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (TCP), in the resolver's order."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise _refuse(f"webhook_url's host {host!r} does not resolve ({exc.strerror or exc})") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class Target:
    """A checked webhook URL: where to connect (a checked address) and what to say (host, path)."""

    url: str
    scheme: str
    host: str
    port: int
    path: str
    address: str

    def connect_url(self) -> str:
        """The URL with the checked address in place of the host name (the name goes in Host and SNI)."""
        ip = ipaddress.ip_address(self.address)
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        return f"{self.scheme}://{host}:{self.port}{self.path}"

    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


class Allowlist:
    """`webhook_hosts`: host names (exact, case-insensitive) and IP addresses or networks."""

    def __init__(self, entries: Sequence[str], resolver: Resolver | None = None) -> None:
        self.resolver = resolver or resolve
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            text = entry.strip().lower().rstrip(".").strip("[]")
            try:
                self.networks.append(ipaddress.ip_network(text, strict=False))
            except ValueError:
                if text:
                    self.names.add(text)

    def __bool__(self) -> bool:
        return bool(self.names or self.networks)

    def listed(self, ip: Address) -> bool:
        return any(ip.version == net.version and ip in net for net in self.networks)

    def check(self, url: Any) -> Target:
        """The URL as a `Target`, or a `RequestError` (param webhook_url) saying why not; connects nowhere."""
        if not self:
            raise _refuse("webhooks are off on this server (webhook_hosts is empty): leave webhook_url out")
        if not isinstance(url, str) or len(url) > 2048:
            raise _refuse("webhook_url must be an http(s) URL of at most 2048 characters")
        try:
            parts = urlsplit(url.strip())
            port = parts.port
        except ValueError as exc:
            raise _refuse(f"webhook_url is not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _refuse("webhook_url must be an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            raise _refuse("webhook_url may not carry a user name or password")
        host = parts.hostname.lower().rstrip(".")
        if port == 0:
            raise _refuse("webhook_url's port 0 is not a port anything listens on")
        port = port or (443 if parts.scheme == "https" else 80)
        literal = _ip(host)
        if (literal is None and host not in self.names) or (literal is not None and not self.listed(literal)):
            raise _refuse(f"webhook_url's host {host!r} is not in this server's webhook_hosts")
        addresses = [host] if literal is not None else self.resolver(host, port)
        if not addresses:
            raise _refuse(f"webhook_url's host {host!r} does not resolve")
        for text in addresses:
            ip = _ip(text)
            if ip is None:
                raise _refuse(f"webhook_url's host {host!r} resolved to {text!r}, not an IP address")
            self._check_address(host, ip)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return Target(url.strip(), parts.scheme, host, port, path, addresses[0])

    def _check_address(self, host: str, ip: Address) -> None:
        """Public addresses pass; private, loopback and other special ones only inside a listed network;
        link-local (the metadata service's range), multicast and unspecified ones never."""
        if ip in METADATA or ip.is_link_local or ip.is_multicast or ip.is_unspecified:
            raise _refuse(f"webhook_url's host {host!r} is at {ip}: link-local, metadata or multicast, never called")
        if not ip.is_global and not self.listed(ip):
            raise _refuse(
                f"webhook_url's host {host!r} is at the non-public address {ip}, which webhook_hosts does not list"
            )


def _ip(text: str) -> Address | None:
    """An address (an IPv6 address that carries an IPv4 one as that IPv4, a zone id dropped), or None for a host
    name. Carriers: IPv4-mapped (::ffff:a.b.c.d), NAT64 (64:ff9b::/96 and the local-use 64:ff9b:1::/48, whose
    gateway connects to the embedded address), 6to4 (2002::/16), SIIT's IPv4-translated (::ffff:0:a.b.c.d) and
    IPv4-compatible (::a.b.c.d): Python calls them global, so unchecked they would reach loopback or the metadata
    service through a translator."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if ip.version == 4:
        return ip
    assert isinstance(ip, ipaddress.IPv6Address)
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    carriers = (*NAT64, TRANSLATED)
    if any(ip in net for net in carriers) or (ip in COMPATIBLE and int(ip) > 1):  # not :: or ::1 themselves
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header: `v1,` + base64 HMAC-SHA256 of `{id}.{timestamp}.{body}`."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")


@dataclass(frozen=True)
class Outcome:
    """One attempt: the answer's status (None when none came), why it failed, and whether it was the last one
    needed (delivered, or refused by the allowlist, which refuses every later attempt too)."""

    status: int | None
    error: str | None
    final: bool

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def attempt(
    allow: Allowlist, url: str, secret: str, msg_id: str, body: bytes, deadline_s: float = TOTAL_TIMEOUT_S
) -> Outcome:
    """POST `body` to `url` once, signed, within `deadline_s` from connect to the answer's last byte read (a
    receiver that drips its answer is cut off then, not after one timeout per read); the URL is checked again
    first (the allowlist or the DNS answer may have changed since submit)."""
    import httpx

    try:
        target = allow.check(url)
    except RequestError as exc:
        log.warning("webhook %s not sent: %s", msg_id, exc)
        return Outcome(None, str(exc), final=True)
    stamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "host": target.host_header(),
        "user-agent": "neuron-app-webhooks",
        "webhook-id": msg_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign(secret, msg_id, stamp, body),
    }
    try:
        status = asyncio.run(asyncio.wait_for(_post(target, headers, body, deadline_s), deadline_s))
    except TimeoutError:
        error = f"no complete answer within {deadline_s:g} s (the deadline of one attempt, connect to last byte)"
        return Outcome(None, error, final=False)
    except httpx.HTTPError as exc:
        return Outcome(None, one_line(exc, limit=200), final=False)
    if 200 <= status < 300:
        return Outcome(status, None, final=True)
    return Outcome(status, f"HTTP {status}", final=False)


async def _post(target: Target, headers: dict[str, str], body: bytes, deadline_s: float) -> int:
    """The status of the answer; at most ANSWER_BYTES of its body are read (nothing in it is used)."""
    import httpx

    timeout = httpx.Timeout(deadline_s, connect=min(CONNECT_TIMEOUT_S, deadline_s))
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    async with (
        httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client,
        client.stream("POST", target.connect_url(), content=body, headers=headers, extensions=extensions) as reply,
    ):
        read = 0
        async for chunk in reply.aiter_raw():
            read += len(chunk)
            if read >= ANSWER_BYTES:
                break
        return reply.status_code


def deliver(
    allow: Allowlist,
    url: str,
    secret: str,
    msg_id: str,
    body: bytes,
    *,
    backoff_s: Sequence[float] = BACKOFF_S,
    sleep: Callable[[float], None] = time.sleep,
    deadline_s: float = TOTAL_TIMEOUT_S,
) -> dict[str, Any]:
    """`attempt` until a 2xx answer or the attempts run out, pausing `backoff_s` between them, in this thread
    (the server's deliveries go through web/jobs/webhook_pool.py instead, which never sleeps a worker). Returns the
    delivery's record: {delivered, attempts, status, last_error}."""
    record: dict[str, Any] = {"delivered": False, "attempts": 0, "status": None, "last_error": None}
    for number, pause in enumerate([0.0, *backoff_s], start=1):
        if pause:
            sleep(pause)
        outcome = attempt(allow, url, secret, msg_id, body, deadline_s)
        record_outcome(record, msg_id, number, outcome)
        if outcome.final:
            break
    return record


def record_outcome(record: dict[str, Any], msg_id: str, number: int, outcome: Outcome) -> None:
    """Attempt `number`'s outcome into the delivery's record (and a warning line when it failed)."""
    record["attempts"] = number
    if outcome.status is not None:
        record["status"] = outcome.status
    record["delivered"], record["last_error"] = outcome.delivered, outcome.error
    if not outcome.final:
        log.warning("webhook %s attempt %d failed: %s", msg_id, number, outcome.error)
