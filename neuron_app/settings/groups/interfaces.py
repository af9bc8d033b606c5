"""The other interfaces: the OpenAI-compatible API and its keys and limits, async jobs and webhooks, MCP."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


def _check_webhook_secret(secret: SecretStr | None) -> None:
    """A Standard Webhooks secret: 'whsec_' + base64 of 24..64 bytes (the value is never put in the message)."""
    import base64
    import binascii

    if secret is None:
        raise ValueError("webhook_hosts is set but NEURON_APP_WEBHOOK_SECRET is not: webhooks are always signed")
    text = secret.get_secret_value()
    try:
        key = base64.b64decode(text.removeprefix("whsec_"), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if not text.startswith("whsec_") or not 24 <= len(key) <= 64:
        raise ValueError("webhook_secret must be 'whsec_' followed by the base64 of 24 to 64 random bytes")


#: API key names become a Prometheus label and log words: short, plain.
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

#: The name `/metrics` gives the old single `api_key`.
DEFAULT_KEY_NAME = "default"

MIN_KEY_CHARS = 16

#: The widest network a `webhook_hosts` entry may name, per IP version (red-team turn 7, row 46).
WIDEST_WEBHOOK_PREFIX = {4: 8, 6: 32}


class ApiKey(BaseModel):
    """One named API key and its limits (images, counted by `n`; 0 = no limit)."""

    model_config = ConfigDict(extra="forbid")

    key: SecretStr = Field(description="The bearer token (at least 16 characters).")
    images_per_minute: int = Field(0, ge=0, description="Images this key may ask for in any 60 seconds; 0 = no limit.")
    images_per_day: int = Field(0, ge=0, description="Images this key may ask for in any 24 hours; 0 = no limit.")


class InterfaceSettings(BaseModel):
    """API keys and per-caller limits, sizes, uploads, connections, the job store's caps, webhook delivery, MCP."""

    api_key: SecretStr | None = Field(
        None,
        description="Bearer key the OpenAI-compatible API asks for (environment only: NEURON_APP_API_KEY). "
        "With page auth and no key the API refuses every request.",
    )

    api_keys: dict[str, ApiKey] = Field(
        {},
        description="Named API keys with their own limits, name -> {key, images_per_minute, images_per_day} "
        "(environment only: NEURON_APP_API_KEYS as JSON). Names appear in /metrics, keys never.",
    )

    max_images: int = Field(4, ge=1, le=16, description="Most images one request may ask for (n; one after another).")

    size_policy: Literal["exact", "nearest"] = Field(
        "exact",
        description="A `size` (or `aspect_ratio`, `output_megapixels`) that is not a served shape: exact = refused "
        "(400); nearest = made at the served shape nearest in aspect ratio and area, then resized and "
        "center-cropped to it, never compiling a new shape.",
    )

    image_url_ttl_s: float = Field(
        3600.0, ge=600.0, description="How long images returned as `url` by the OpenAI API stay downloadable."
    )

    page_images_per_minute: int | None = Field(
        None,
        ge=0,
        description="Images one client address may ask for in any 60 seconds through the page, gradio_client and "
        "MCP (and the OpenAI API when no key is configured); 0 = no limit; unset = 10 when others can reach the "
        "app (share = true or a non-loopback server_name), else no limit.",
    )

    upload_mb_per_minute: float = Field(
        200.0, gt=0, description="MB one client address may upload to Gradio (/gradio_api/upload) in any 60 seconds."
    )

    upload_total_mb: float = Field(
        4096.0,
        gt=0,
        description="MB all addresses together may upload to Gradio in any hour (it keeps uploads up to an hour).",
    )

    max_connections: int = Field(
        1000,
        ge=8,
        description="Requests in progress (headers read, until their answer ends) the server takes at once; beyond "
        "it, 503 (/healthz and /readyz excepted).",
    )

    max_connections_per_address: int = Field(
        64, ge=1, description="Requests in progress one client address may have at once; beyond it, 503."
    )

    header_timeout_s: float = Field(
        10.0, gt=0, le=300, description="A connection whose request headers are not complete within this is closed."
    )

    request_body_mb: float = Field(
        1.0,
        gt=0,
        description="Largest body of a Gradio or MCP request that is not an upload (JSON: prompts, file references).",
    )

    body_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A request's whole body must arrive within this, from its headers' end; a slower one is "
        "cut with a 408 and its connection closed (every route).",
    )

    max_header_kb: int = Field(
        64, ge=8, le=1024, description="Most kilobytes of one request's headers; beyond it, a 431 and a close."
    )

    address_body_mb: float = Field(
        256.0,
        gt=0,
        description="Bytes of request bodies one client address may have in flight at once (declared or received, "
        "held until each request ends); beyond it, a 429 before the body is read.",
    )

    send_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A response the client stops reading (the server's send buffer full) for this long has its "
        "connection closed, on every route: an unread answer cannot hold its place.",
    )

    max_streams: int = Field(
        256,
        ge=1,
        description="Long-lived answers (Gradio's heartbeat and queue streams, MCP streams, stream=true) open at "
        "once, counted apart from max_connections; at the cap the oldest of the address with the most is ended.",
    )

    max_streams_per_address: int = Field(
        32,
        ge=1,
        description="Long-lived answers one client address may have open at once; one more ends its oldest.",
    )

    mcp_server: bool = Field(
        True, description="Serve generate and status as MCP tools at /gradio_api/mcp/ (off while page auth is on)."
    )

    job_ttl_s: float = Field(
        86400.0,
        ge=60.0,
        description="How long a finished asynchronous job of the OpenAI API (Prefer: respond-async) and its images "
        "stay readable at /v1/images/jobs/{id}, restarts included; then both are deleted.",
    )

    jobs_per_key: int = Field(
        16,
        ge=0,
        description="Asynchronous jobs one key (or, with no keys, all callers together) may have queued or "
        "running at once; more are a 429 jobs_full. 0 = no cap.",
    )

    jobs_stored_per_key: int = Field(
        1000,
        ge=0,
        description="Asynchronous jobs one key may hold in the job store, ended ones included until job_ttl_s "
        "deletes them; more are a 429 jobs_full. 0 = no cap.",
    )

    job_images_max: int = Field(
        2000,
        ge=0,
        description="Most b64_json job images kept on disk; above it the oldest ended jobs are deleted early "
        "(in the background), before job_ttl_s. 0 = no cap.",
    )

    job_images_max_bytes: int = Field(
        2 * 1024**3,
        ge=0,
        description="Most bytes of b64_json job images kept on disk; above it the oldest ended jobs are deleted "
        "early (in the background). 0 = no cap.",
    )

    webhook_hosts: list[str] = Field(
        [],
        description="Hosts an asynchronous job's webhook_url may name (host names, IP addresses or networks such as "
        "10.0.0.0/8, at most a /8; IPv6 a /32); empty: webhook_url is refused. Private and loopback addresses must "
        "be listed; link-local ones and the clouds' metadata services (169.254.169.254, 100.100.100.200) never pass.",
    )

    webhook_secret: SecretStr | None = Field(
        None,
        description="Standard Webhooks signing secret, 'whsec_' + base64 of 24-64 random bytes (environment only: "
        "NEURON_APP_WEBHOOK_SECRET); needed when webhook_hosts is set.",
    )

    webhook_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=120.0,
        description="Deadline of one webhook attempt, from connect to the answer's last byte (a receiver that "
        "drips its answer is cut off then); a cut attempt is retried like a failed one.",
    )

    webhook_workers: int = Field(4, ge=1, le=64, description="Threads that deliver webhooks (a fixed pool).")

    webhook_queue: int = Field(
        1000,
        ge=1,
        description="Webhook deliveries that may wait or run at once; one more is not attempted and its job "
        "records the delivery as failed.",
    )

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: dict[str, ApiKey]) -> dict[str, ApiKey]:
        seen: set[str] = set()
        for name, entry in value.items():
            if not _KEY_NAME.fullmatch(name):
                raise ValueError(
                    f"API key name {name!r} is not allowed (1-64 of A-Z a-z 0-9 _ . -, a letter or digit first)"
                )
            secret = entry.key.get_secret_value()
            if len(secret) < MIN_KEY_CHARS or secret.strip() != secret:
                raise ValueError(
                    f"API key {name!r} is too short or has surrounding spaces: use at least {MIN_KEY_CHARS} "
                    "characters, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
                )
            if secret in seen:
                raise ValueError(f"API key {name!r} has the same key as another name")
            seen.add(secret)
        return value

    @field_validator("webhook_hosts")
    @classmethod
    def _check_webhook_hosts(cls, value: list[str]) -> list[str]:
        """Host names, IP addresses or networks; a URL or a host:port would silently match nothing."""
        import ipaddress

        for entry in value:
            text = entry.strip().lower().rstrip(".").strip("[]")
            try:
                network = ipaddress.ip_network(text, strict=False)
            except ValueError:
                if not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", text):
                    raise ValueError(
                        f"webhook_hosts entry {entry!r} is not a host name, an IP address or a network "
                        "(no scheme, port or path: 'hooks.example.com', '10.0.0.5', '10.0.0.0/8')"
                    ) from None
                continue
            widest = WIDEST_WEBHOOK_PREFIX[network.version]
            if network.prefixlen < widest:  # 0.0.0.0/0 let a caller pick any address the checks do not name
                raise ValueError(
                    f"webhook_hosts entry {entry!r} is wider than a /{widest}: list the receivers' own hosts or "
                    "networks (public addresses need no entry)"
                )
        return value
