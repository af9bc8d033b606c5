"""Webhooks of asynchronous jobs: which URLs may be called, Standard Webhooks signatures, bounded retries.

A webhook makes the server open a connection where a caller says: on AWS that is an SSRF door to the instance
metadata service (169.254.169.254) and the VPC. So a `webhook_url` must name a host listed in `webhook_hosts`,
and every address the host resolves to must be public or inside a listed network; link-local addresses (the
metadata service among them) never pass. The check runs at submit time (a 400 naming `webhook_url`, no
connection made) and again before every attempt, and the connection goes to the address that was checked (the
host name only in `Host` and TLS's SNI), so a DNS answer that changes in between (rebinding) is not followed.
Redirects are not followed either.

Signatures follow the Standard Webhooks spec (standardwebhooks.com): headers `webhook-id` (the same on every
attempt), `webhook-timestamp` and `webhook-signature` = `v1,` + base64 HMAC-SHA256 of `{id}.{timestamp}.{body}`
under the base64-decoded `whsec_` secret; any Standard Webhooks library verifies them.
"""

from __future__ import annotations

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
TOTAL_TIMEOUT_S = 10.0
#: Answered and never a target, even if listed: the cloud metadata services (AWS, ECS, GCP/Azure share the first).
METADATA = (
    ipaddress.ip_address("169.254.169.254"),
    ipaddress.ip_address("169.254.170.2"),
    ipaddress.ip_address("fd00:ec2::254"),
)

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
    """An address (IPv4-mapped IPv6 as its IPv4, a zone id dropped), or None for a host name."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header: `v1,` + base64 HMAC-SHA256 of `{id}.{timestamp}.{body}`."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")


def deliver(
    allow: Allowlist,
    url: str,
    secret: str,
    msg_id: str,
    body: bytes,
    *,
    backoff_s: Sequence[float] = BACKOFF_S,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """POST `body` to `url`, signed, until a 2xx answer or the attempts run out; the URL is checked again before
    every attempt. Returns the delivery's record: {delivered, attempts, status, last_error}."""
    import httpx

    record: dict[str, Any] = {"delivered": False, "attempts": 0, "status": None, "last_error": None}
    timeout = httpx.Timeout(TOTAL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    for attempt, pause in enumerate([0.0, *backoff_s], start=1):
        if pause:
            sleep(pause)
        record["attempts"] = attempt
        try:
            target = allow.check(url)  # again: the allowlist or the DNS answer may have changed since submit
        except RequestError as exc:
            record["last_error"] = str(exc)
            log.warning("webhook %s not sent: %s", msg_id, exc)
            return record  # refused now: refused on every later attempt too
        stamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "host": target.host_header(),
            "user-agent": "neuron-app-webhooks",
            "webhook-id": msg_id,
            "webhook-timestamp": str(stamp),
            "webhook-signature": sign(secret, msg_id, stamp, body),
        }
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        try:
            with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
                reply = client.post(target.connect_url(), content=body, headers=headers, extensions=extensions)
            record["status"] = reply.status_code
            if 200 <= reply.status_code < 300:
                record["delivered"], record["last_error"] = True, None
                return record
            record["last_error"] = f"HTTP {reply.status_code}"
        except httpx.HTTPError as exc:
            record["last_error"] = one_line(exc, limit=200)
        log.warning("webhook %s attempt %d failed: %s", msg_id, attempt, record["last_error"])
    return record
