"""Settings of stored state and what it may trust, a mixin of `Settings` (settings.py): the job store's caps and
the webhook deliveries, the watermark's key, the shared compile cache's signing secret.

Apart from settings_groups.py so each group stays readable; the fields are read from `settings.toml` and
`NEURON_APP_*` like every other, and documented in docs/configuration.md.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr, model_validator

#: The shortest cache_remote_secret accepted.
MIN_CACHE_SECRET = 32


class StoredStateSettings(BaseModel):
    """How much the job store holds (web/job_store.py), how webhooks are delivered (web/webhook_pool.py), the
    watermark's key (engine/trust/marks.py)."""

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
    watermark_secret: SecretStr | None = Field(
        None,
        description="Key of the watermark (environment only: NEURON_APP_WATERMARK_SECRET): when set, each image's "
        "48 bits are a random 24-bit image id and 24 bits of its HMAC-SHA256 under this key, which verify checks "
        "(with the same key); unset: the public watermark_payload.",
    )
    cache_remote_secret: SecretStr | None = Field(
        None,
        description="Key that signs the shared compile cache's index parts (HMAC-SHA256; environment only: "
        "NEURON_APP_CACHE_REMOTE_SECRET, at least 32 characters, the same on every instance); needed when "
        "cache_remote is set: unsigned or wrongly signed parts are refused.",
    )

    @model_validator(mode="after")
    def _check_cache_remote_secret(self) -> StoredStateSettings:
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
