"""Groups of settings, as mixins of `Settings` (settings.py): how the app is shared, how it spreads, and what an
edit may carry.

Kept apart so settings.py stays readable; every field still comes from `settings.toml` and `NEURON_APP_*`
like the others (pydantic-settings reads the fields of the whole class), and each is documented in
docs/configuration.md.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, WrapValidator, field_validator

from neuron_app.errors import ShapeError
from neuron_app.shapes import Resolution

_S3_URL = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?$")


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix") for `cache_remote`; ValueError naming the form."""
    match = _S3_URL.match(url.strip())
    if not match:
        raise ValueError(f"cache_remote {url!r} is not of the form s3://bucket/prefix (bucket: 3-63 of a-z 0-9 . -)")
    prefix = (match.group("prefix") or "").strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"cache_remote {url!r} has an empty, '.' or '..' path segment")
    return match.group("bucket"), prefix


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


class ReplicaRange(int):
    """`replicas` as an int (its maximum, what every caller sizes by: lanes, Ray CPUs) that also knows its minimum:
    "1-4" scales between 1 and 4 replicas with the queue (Ray Serve autoscaling); a plain 2 is min = max = 2."""

    min: int

    def __new__(cls, maximum: int, minimum: int | None = None) -> ReplicaRange:
        obj = super().__new__(cls, maximum)
        obj.min = maximum if minimum is None else minimum
        return obj

    @property
    def max(self) -> int:
        return int(self)

    def __getnewargs__(self) -> tuple[int, int]:  # pickled to the replicas with the settings
        return (int(self), self.min)


def _replica_range(value: Any, handler: Any) -> ReplicaRange:
    """An int, or "MIN-MAX" (each checked by the field's bounds); MIN above MAX is refused."""
    if isinstance(value, ReplicaRange):
        return value
    if isinstance(value, str) and "-" in value.strip().lstrip("-"):
        low, _, high = value.strip().partition("-")
        minimum, maximum = handler(low.strip()), handler(high.strip())
        if minimum > maximum:
            raise ValueError(f"replicas {value!r}: MIN is above MAX (write MIN-MAX, e.g. 1-4)")
        return ReplicaRange(maximum, minimum)
    return ReplicaRange(handler(value))


#: API key names become a Prometheus label and log words: short, plain.
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: The name `/metrics` gives the old single `api_key`.
DEFAULT_KEY_NAME = "default"
MIN_KEY_CHARS = 16


class ApiKey(BaseModel):
    """One named API key and its limits (images, counted by `n`; 0 = no limit)."""

    model_config = ConfigDict(extra="forbid")

    key: SecretStr = Field(description="The bearer token (at least 16 characters).")
    images_per_minute: int = Field(0, ge=0, description="Images this key may ask for in any 60 seconds; 0 = no limit.")
    images_per_day: int = Field(0, ge=0, description="Images this key may ask for in any 24 hours; 0 = no limit.")


class InterfaceSettings(BaseModel):
    """The OpenAI-compatible API, MCP, API keys and limits, async jobs, the safety checker and the marks."""

    # --- other interfaces: OpenAI-compatible Images API, MCP, several images per request ----------
    api_key: SecretStr | None = Field(
        None,
        description="Bearer key the OpenAI-compatible API asks for (environment only: NEURON_APP_API_KEY). "
        "With page auth and no key the API refuses every request.",
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
    api_keys: dict[str, ApiKey] = Field(
        {},
        description="Named API keys with their own limits, name -> {key, images_per_minute, images_per_day} "
        "(environment only: NEURON_APP_API_KEYS as JSON). Names appear in /metrics, keys never.",
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
        1000, ge=8, description="Open connections the server takes (uvicorn's limit_concurrency); beyond it, 503."
    )
    blocked_terms: list[str] = Field(
        [],
        description="Prompts containing one of these words or phrases are refused before any model work "
        "(whole words, case-insensitive, after Unicode normalisation).",
    )
    blocked_terms_file: Path | None = Field(
        None, description="A UTF-8 file of more blocked terms, one a line (# comments); re-read when it changes."
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
    webhook_hosts: list[str] = Field(
        [],
        description="Hosts an asynchronous job's webhook_url may name (host names, IP addresses or networks such as "
        "10.0.0.0/8); empty: webhook_url is refused. Private and loopback addresses must be listed; link-local "
        "ones (169.254.169.254) never pass.",
    )
    webhook_secret: SecretStr | None = Field(
        None,
        description="Standard Webhooks signing secret, 'whsec_' + base64 of 24-64 random bytes (environment only: "
        "NEURON_APP_WEBHOOK_SECRET); needed when webhook_hosts is set.",
    )

    # --- sharing safely: the safety checker and AI-content marks (engine/trust/safety.py, engine/trust/marks.py)
    safety_checker: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Classify every generated image on the host CPU and refuse flagged ones (nothing is stored "
        "or returned); auto = on when others can reach the app (share = true or a non-loopback server_name).",
    )
    safety_model: str = Field(
        "Falconsai/nsfw_image_detection",
        description="Image classifier of the safety checker (Apache-2.0 ViT, loaded through transformers): a Hub "
        "id or local folder with an 'nsfw' label, or 'tiny' for the offline stand-in the tests use.",
    )
    safety_threshold: float = Field(
        0.5, gt=0.0, lt=1.0, description="An image whose 'nsfw' probability reaches this is refused."
    )
    postprocess_workers: int = Field(
        2,
        ge=0,
        le=64,
        description="Host slots for the work after the device (safety check, marks, encode): a device lane hands "
        "its image over and takes the next request at once, and waits only when all are busy; 0 = in-line.",
    )
    safety_threads: int = Field(
        1, ge=1, le=64, description="CPU threads the safety classifier's batch runs on (torch's intra-op threads)."
    )
    watermark_payload: str = Field(
        "FLUX2K",
        description="The 6 ASCII characters (48 bits) of the invisible watermark (lumaQim: engine/trust/watermark.py) "
        "on every image of at least 256x256.",
    )
    c2pa_cert: Path | None = Field(
        None,
        description="PEM certificate chain (signing certificate first) for every image's C2PA manifest; unset: "
        "a per-install local chain made under cache_dir/c2pa, which no validator trusts by default.",
    )
    c2pa_key: Path | None = Field(
        None, description="PEM private key of c2pa_cert (EC P-256/P-384, Ed25519 or RSA); readable by the server only."
    )
    c2pa_key_passphrase: SecretStr | None = Field(
        None, description="Passphrase of an encrypted c2pa_key (environment only: NEURON_APP_C2PA_KEY_PASSPHRASE)."
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

    @field_validator("blocked_terms")
    @classmethod
    def _check_blocked_terms(cls, value: list[str]) -> list[str]:
        for term in value:
            if not isinstance(term, str) or not re.search(r"[^\W_]", term):
                raise ValueError(f"blocked term {term!r} has no letter or digit: it would match nothing")
        return [term.strip() for term in value]

    @field_validator("blocked_terms_file")
    @classmethod
    def _check_blocked_terms_file(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        path = value.expanduser().resolve()
        try:
            path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"blocked_terms_file {path} cannot be read as UTF-8 text: {exc}") from None
        return path

    @field_validator("watermark_payload")
    @classmethod
    def _check_watermark_payload(cls, value: str) -> str:
        if len(value) != 6 or not all(" " < ch < "\x7f" for ch in value):
            raise ValueError(f"watermark_payload {value!r} must be exactly 6 printable ASCII characters (48 bits)")
        return value

    @field_validator("c2pa_cert", "c2pa_key")
    @classmethod
    def _check_c2pa_files(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        path = value.expanduser().resolve()
        if not path.is_file() or not os.access(path, os.R_OK):
            raise ValueError(f"{path} is not a readable file")
        return path


class FleetSettings(BaseModel):
    """Replicas behind Ray Serve, fixed or following the queue."""

    # --- replicas (Ray Serve) ---------------------------------------------------------------
    replicas: Annotated[int, WrapValidator(_replica_range)] = Field(
        1,
        ge=1,
        le=256,
        validate_default=True,
        description="Model replicas serving in parallel, each with its own cores, behind Ray Serve; "
        '1 (and no ray_address) serves in this process without Ray; "MIN-MAX" (e.g. "1-4") scales between '
        "them with the queue (Ray Serve autoscaling).",
    )
    autoscale_target_ongoing: float = Field(
        1.0,
        gt=0.0,
        description='With replicas = "MIN-MAX": requests per replica (running plus queued at it) that Ray Serve '
        "aims at; above it a replica is added (each replica runs one request at a time).",
    )
    autoscale_upscale_delay_s: float = Field(
        30.0,
        ge=0.0,
        description='With replicas = "MIN-MAX": how long the load must stay high before a replica is added.',
    )
    autoscale_downscale_delay_s: float = Field(
        600.0,
        ge=0.0,
        description='With replicas = "MIN-MAX": how long the load must stay low before a replica is removed (a new '
        "replica loads the model and its graphs again).",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join ('auto', 'host:port', 'ray://...'); unset: with replicas > 1 the app "
        "starts a local Ray instance itself and stops it on exit.",
    )
    ray_serve_app: Literal["deploy", "attach"] = Field(
        "deploy",
        description='With ray_address: "deploy" deploys the replicas from this process; "attach" serves through '
        "the replicas a KubeRay RayService deployed (serveConfigV2 import_path neuron_app.scale.serve_app:app), "
        "waiting for them, and leaves them running on exit.",
    )
    cores_per_replica: int = Field(
        1,
        ge=1,
        description="Cores each replica asks Ray for: NeuronCores (the neuron_cores resource) on Neuron, "
        "GPUs on CUDA, CPUs (and torch threads) on CPU. Keep 1 on Neuron: a replica runs on one core.",
    )


#: References are resized to buckets the pipeline leaves as they are: at most 1024x1024 in area, 64 px a side.
MAX_REFERENCE_AREA = 1024 * 1024
MIN_REFERENCE_SIDE = 64


class EditingSettings(BaseModel):
    """Editing with reference images: how many, the buckets they are fitted to, and how big an upload may be."""

    # --- editing with reference images -------------------------------------------------------
    max_references: int = Field(4, ge=0, le=16, description="Reference images an edit may carry; 0 turns editing off.")
    reference_resolutions: list[str] = Field(
        [],
        description="Buckets every reference is resized and center-cropped to (nearest aspect ratio), as WIDTHxHEIGHT, "
        "multiples of 16, at most 1024x1024 in area; empty = the served resolutions up to that area.",
    )
    max_upload_mb: float = Field(
        20.0,
        gt=0,
        le=1024,
        description="Largest uploaded file, in MB (Gradio's max_file_size; also checked per reference).",
    )
    max_reference_pixels: int = Field(
        50_000_000,
        ge=4096,
        le=178_956_970,  # Pillow's own hard limit (2 x Image.MAX_IMAGE_PIXELS): beyond it Pillow refuses anyway
        description="Largest reference image in pixels (width x height), checked before decoding: "
        "decompression bombs are refused.",
    )

    @field_validator("reference_resolutions")
    @classmethod
    def _check_reference_resolutions(cls, value: list[str]) -> list[str]:
        for text in value:
            try:
                res = Resolution.parse(text)
            except ShapeError as exc:
                raise ValueError(str(exc)) from None
            if res.width * res.height > MAX_REFERENCE_AREA or min(res.width, res.height) < MIN_REFERENCE_SIDE:
                raise ValueError(
                    f"reference resolution {res} must be at most {MAX_REFERENCE_AREA} pixels in area "
                    f"and at least {MIN_REFERENCE_SIDE} px a side (the pipeline would resize it otherwise)"
                )
        return value


class LoraSettings(BaseModel):
    """LoRA styles switched in place per request (engine/modes/lora.py)."""

    # --- LoRA styles (engine/modes/lora.py) ------------------------------------------------------------
    loras: dict[str, str] = Field(
        {},
        description="LoRA styles offered per request, name -> source: a .safetensors file, a folder "
        "(folder:weight.safetensors), a Hub id (owner/repo:weight.safetensors), or tiny:<seed> (a random "
        "LoRA for the tiny model). Switched in place without recompiling.",
    )
    max_lora_rank: int = Field(
        64, ge=1, le=1024, description="Hotswap target rank: every adapter is padded to it; higher ranks are refused."
    )
    max_lora_scale: float = Field(2.0, gt=0.0, le=100.0, description="Largest LoRA scale a request may ask for.")
    max_loras_per_request: int = Field(
        3,
        ge=1,
        le=8,
        description="Most LoRA styles one request may combine: one compiled slot each (at most the number of loras).",
    )


class ServerSettings(BaseModel):
    """The HTTP server: address, port, share link, queue, basic auth, shutdown, logging, strict environment."""

    # --- server ------------------------------------------------------------------------------
    server_name: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 to serve the network.")
    server_port: int = Field(7860, ge=1, le=65535, description="HTTP port.")
    share: bool = Field(False, description="Open a public gradio.live link.")
    queue_max_size: int = Field(16, ge=1, description="Requests waiting beyond this get 'busy, try again'.")
    concurrency_limit: int = Field(1, ge=1, description="Generations run at once on the device.")
    auth_username: str | None = Field(None, description="Basic-auth user (environment only).")
    auth_password: SecretStr | None = Field(None, description="Basic-auth password (environment only).")
    allow_public_without_auth: bool = Field(
        False, description="Permit share=true with no auth (a loud warning is printed)."
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0.0,
        le=3600.0,
        description="On SIGTERM/SIGINT: new requests are refused and running ones get this long to finish "
        "before the server closes.",
    )
    log_level: str = Field("INFO", description="Python logging level.")
    otel_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP endpoint for OpenTelemetry traces (e.g. http://collector:4318); unset: the standard "
        "OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing (the SDK is not imported).",
    )
    strict_env: bool = Field(
        False,
        description="A NEURON_APP_* variable that is not a setting stops the start (default: a warning that "
        "names the closest setting).",
    )
