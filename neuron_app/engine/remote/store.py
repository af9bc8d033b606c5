"""The S3 side of the remote compile cache: keys, a client with timeouts, verified object transfers.

Layout under `s3://bucket/prefix` (content-addressed, so concurrent pushes of the same bytes are idempotent):

    <prefix>/<fingerprint>/objects/<sha256>          one compiled artifact (metadata: sha256)
    <prefix>/<fingerprint>/index/<instance>.json     one pusher's listing: manifest entries, path/size/sha256

Each pusher writes only its own index part, objects first and the part last; readers merge the parts, so two
instances pushing one shape at once leave one consistent entry and no reader sees a part naming missing objects.
boto3 is imported only here, only when `cache_remote` is set; credentials come from the standard chain and any
S3-compatible store is reached through `AWS_ENDPOINT_URL`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_app.errors import Unavailable
from neuron_app.settings import parse_s3_url

INDEX_VERSION = 1
CHUNK = 1 << 20
FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class RemoteError(Unavailable, RuntimeError):
    """The store could not be used (unreachable, refused, not configured); the message is one line."""

    default_code = "cache_remote_unavailable"


class BadObject(ValueError):
    """One downloaded object failed its checks (size, sha256); it is ignored."""


def parse_url(url: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix), checked as the setting is."""
    return parse_s3_url(url)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe(exc: BaseException) -> str:
    """One line for a store error, without request ids or credentials."""
    response = getattr(exc, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    text = f"{code}: {exc}" if code else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]


@dataclass(frozen=True)
class ListedObject:
    key: str
    size: int
    etag: str


class Store:
    """One bucket and prefix, one boto3 client with connect/read timeouts and few retries."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise RemoteError("cache_remote is set but boto3 is not installed: pip install boto3") from exc
        config = Config(
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            retries={"max_attempts": 2, "mode": "standard"},
            max_pool_connections=16,
        )
        self.client = boto3.session.Session().client("s3", config=config)

    # --- keys ---------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def object_key(self, fingerprint: str, sha: str) -> str:
        return self.key(fingerprint, "objects", sha)

    def index_key(self, fingerprint: str, instance: str) -> str:
        return self.key(fingerprint, "index", f"{instance}.json")

    # --- listing ------------------------------------------------------------------------------
    def list(self, *parts: str) -> Iterator[ListedObject]:
        prefix = self.key(*parts) + "/"
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                yield ListedObject(item["Key"], int(item["Size"]), item.get("ETag", ""))

    def fingerprints(self) -> list[str]:
        """The fingerprints that have a folder under the prefix."""
        prefix = self.key() + "/" if self.prefix else ""
        found = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(prefix) :].strip("/")
                if FINGERPRINT.match(name):
                    found.append(name)
        return sorted(found)

    # --- objects --------------------------------------------------------------------------------
    def put_file(self, key: str, path: Path, sha: str) -> None:
        """Upload with the sha256 in the metadata (multipart for big files, by s3transfer)."""
        self.client.upload_file(str(path), self.bucket, key, ExtraArgs={"Metadata": {"sha256": sha}})

    def put_json(self, key: str, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, indent=1, sort_keys=True).encode()
        sha = hashlib.sha256(body).hexdigest()
        self.client.put_object(
            Bucket=self.bucket, Key=key, Body=body, ContentType="application/json", Metadata={"sha256": sha}
        )

    def get_json(self, key: str, limit: int = 64 << 20) -> Any:
        response = self.client.get_object(Bucket=self.bucket, Key=key)
        if int(response.get("ContentLength", 0)) > limit:
            raise BadObject(f"{key} is larger than {limit} bytes")
        return json.loads(response["Body"].read())

    def get_verified(self, key: str, target: Path, size: int, sha: str) -> None:
        """Stream an object into `target`, hashing as it comes; `BadObject` unless size and sha256 match."""
        response = self.client.get_object(Bucket=self.bucket, Key=key)
        meta = (response.get("Metadata") or {}).get("sha256")
        if meta is not None and meta != sha:
            raise BadObject(f"its metadata sha256 {meta[:12]}... is not the index's {sha[:12]}...")
        digest, count = hashlib.sha256(), 0
        with target.open("wb") as fh:
            for chunk in response["Body"].iter_chunks(CHUNK):
                count += len(chunk)
                if count > size:
                    raise BadObject(f"longer than the index's {size} bytes")
                digest.update(chunk)
                fh.write(chunk)
        if count != size:
            raise BadObject(f"truncated: {count} of {size} bytes")
        if digest.hexdigest() != sha:
            raise BadObject(f"sha256 mismatch: got {digest.hexdigest()[:12]}..., index says {sha[:12]}...")
