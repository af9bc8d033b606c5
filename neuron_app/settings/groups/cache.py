"""Where compiled artifacts are kept: the local folder, the shared S3 cache and its signing key, the prompt cache."""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

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


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "neuron-app"


#: The shortest cache_remote_secret accepted.
MIN_CACHE_SECRET = 32


class CacheSettings(BaseModel):
    """The persistent cache folder (graphs, manifest, outputs), the S3-shared cache, the encoded-prompt cache."""

    cache_dir: Path = Field(
        default_factory=_default_cache_dir,
        description="Persistent folder for compiled artifacts (NEFF / inductor), the manifest, "
        "the tiny model and outputs. Never /tmp: it is wiped on reboot.",
    )

    state_dir: Path | None = Field(
        None,
        description="Folder of this process's own state: the job store, the usage book, job images (SQLite, so "
        "local disk, one process: a second one is refused at start); unset: cache_dir.",
    )

    prompt_cache_size: int = Field(
        64, ge=0, description="Encoded prompts kept (LRU) so repeated prompts skip the text encoder; 0 = off."
    )

    cache_remote: str | None = Field(
        None,
        description="s3://bucket/prefix holding compiled artifacts for many instances: `cache push` uploads, "
        "the app pulls its fingerprint's at start and before compiling (boto3, standard AWS credentials, "
        "AWS_ENDPOINT_URL for S3-compatible stores); unset: off.",
    )

    cache_remote_timeout_s: float = Field(
        10.0, gt=0.0, le=600.0, description="Connect and read timeout of each S3 call; a slow store is skipped."
    )

    cache_remote_secret: SecretStr | None = Field(
        None,
        description="Key that signs the shared compile cache's index parts (HMAC-SHA256; environment only: "
        "NEURON_APP_CACHE_REMOTE_SECRET, at least 32 characters, the same on every instance); needed when "
        "cache_remote is set: unsigned or wrongly signed parts are refused.",
    )

    @field_validator("cache_dir")
    @classmethod
    def _check_cache_dir(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @field_validator("state_dir")
    @classmethod
    def _check_state_dir(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser().resolve()

    @field_validator("cache_remote")
    @classmethod
    def _check_cache_remote(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        bucket, prefix = parse_s3_url(value)
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    @model_validator(mode="after")
    def _check_cache_remote_secret(self) -> CacheSettings:
        if getattr(self, "cache_remote", None) is None:
            return self
        secret = self.cache_remote_secret.get_secret_value() if self.cache_remote_secret is not None else ""
        if len(secret) < MIN_CACHE_SECRET:
            raise ValueError(
                "cache_remote is set but NEURON_APP_CACHE_REMOTE_SECRET is missing or shorter than "
                f"{MIN_CACHE_SECRET} characters: the shared cache's index is always signed, e.g. "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return self

    @property
    def state_folder(self) -> Path:
        """Where the job store, the usage book and job images live: `state_dir`, else `cache_dir`."""
        return self.state_dir or self.cache_dir

    @property
    def outputs_dir(self) -> Path:
        """Generated images (the page's, the API's, the OpenAI API's `url` answers): served from where they lie."""
        return self.cache_dir / "outputs"
