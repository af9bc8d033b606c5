"""Sharing safely: blocked terms, the safety checker, the watermark and the C2PA signing identity."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator


class TrustSettings(BaseModel):
    """What is refused before and after the model, and what marks every image as AI-made."""

    blocked_terms: list[str] = Field(
        [],
        description="Prompts containing one of these words or phrases are refused before any model work "
        "(whole words, case-insensitive, after Unicode normalisation).",
    )

    blocked_terms_file: Path | None = Field(
        None, description="A UTF-8 file of more blocked terms, one a line (# comments); re-read when it changes."
    )

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
    safety_threads: int = Field(
        1, ge=1, le=64, description="CPU threads the safety classifier's batch runs on (torch's intra-op threads)."
    )
    safety_device: Literal["host", "device"] = Field(
        "host",
        description="Where the safety classifier runs: host (the post stage's CPU threads, batched across post "
        "slots) or device (one static-shape graph, batch 1, compiled with the model's shapes: the device lane "
        "classifies each image before it takes the next request, and the host has only the marks and the encode).",
    )

    watermark_payload: str = Field(
        "FLUX2K",
        description="The 6 ASCII characters (48 bits) of the invisible watermark (lumaQim: engine/trust/watermark.py) "
        "on every image of at least 256x256.",
    )

    watermark_secret: SecretStr | None = Field(
        None,
        description="Key of the watermark (environment only: NEURON_APP_WATERMARK_SECRET): when set, each image's "
        "48 bits are a random 24-bit image id and 24 bits of its HMAC-SHA256 under this key, which verify checks "
        "(with the same key); unset: the public watermark_payload.",
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

    @property
    def safety_on(self) -> bool:
        """The safety checker in force: on, off, or auto = on when others can reach the app."""
        return self.safety_checker == "on" or (self.safety_checker == "auto" and self.reachable_by_others)
