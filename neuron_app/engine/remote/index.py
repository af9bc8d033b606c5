"""The remote cache's index: which files a cache folder holds, and the pushers' index parts read back, checked
and merged. Pure functions over names, paths and parsed JSON; the pulling and pushing is `remote_cache`.

Anyone who can write to the bucket could plant a part and its objects, and the sha256 checks only compare the
objects with that same bucket's index. So every part carries an HMAC-SHA256 under `cache_remote_secret`, over
its canonical JSON (`sign_part`), and a part that is unsigned or wrongly signed is refused before anything in it
is read. And a file is installed only if it is of a kind its artifact folder holds (`KINDS`): compiled code
that Python or the loader runs (.py, .so) only under inductor, whose compiler writes it; NEFF folders hold data.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from neuron_app.engine.cache.manifest import ARTIFACT_DIRS, ManifestEntry, fingerprint_of
from neuron_app.engine.remote.store import INDEX_VERSION, SHA256, BadObject, Store

#: Roots whose files refer to each other (inductor's FX-graph and AOT-autograd entries name code files):
#: one bad object there drops the whole root; elsewhere (one NEFF per folder) only its folder.
WHOLE_ROOTS = ("inductor",)
STAGING_PREFIX = ".remote-pull-"
#: The file kinds (name suffixes) each artifact folder may receive from the remote; None: any name its compiler
#: picks (inductor writes generated .py wrappers, .cpp/.so kernels and hash-named entries). Other folders are
#: NEFF caches (the Neuron compiler's, the emulator's `neff-emulated`, the cache folder's `neff`): data only.
KINDS: dict[str, tuple[str, ...] | None] = {"inductor": None}
NEFF_KINDS = (".neff", ".json", ".pb", ".gz", ".done", ".txt", ".log", ".ntff", ".hlo")
SIGNATURE = "signature"
_SIGNED = b"neuron-app cache index v1\n"


def allowed_kind(rel: str) -> bool:
    """Whether a remote file's kind is one its artifact folder holds (see KINDS)."""
    parts = PurePosixPath(rel).parts
    kinds = KINDS.get(parts[0], NEFF_KINDS)
    return kinds is None or PurePosixPath(rel).name.lower().endswith(kinds)


def _canonical(data: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in data.items() if k != SIGNATURE}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_part(secret: str, data: dict[str, Any]) -> str:
    """The part's signature: `v1=` + hex HMAC-SHA256 under the secret of its canonical JSON (signature left out)."""
    return "v1=" + hmac.new(secret.encode(), _SIGNED + _canonical(data), hashlib.sha256).hexdigest()


def check_signature(secret: str, data: Any) -> None:
    """`BadObject` unless the part carries this secret's signature."""
    if not secret:
        raise BadObject("cache_remote_secret is not set: no index part can be checked, so none is used")
    if not isinstance(data, dict) or not isinstance(data.get(SIGNATURE), str):
        raise BadObject("index part is unsigned (cache_remote_secret): refused")
    if not hmac.compare_digest(data[SIGNATURE], sign_part(secret, data)):
        raise BadObject("index part is not signed with this server's cache_remote_secret: refused")


def artifact_roots(backend: Any, cache_dir: Path) -> dict[str, Path]:
    """Name -> folder (or file) of every compiled artifact kept: the backend's folders and the cache's own."""
    base = cache_dir.resolve()
    roots: dict[str, Path] = {}
    for path in [*backend.compiled_artifacts_dirs(cache_dir), *(cache_dir / n for n in ARTIFACT_DIRS)]:
        try:
            name = path.resolve().relative_to(base).as_posix()
        except ValueError:
            name = path.name  # a NEFF folder the user placed elsewhere: named by its folder
        roots.setdefault(name, path)
    return roots


def unit_of(rel: str) -> str:
    """What a file is installed with: its whole root for inductor, its folder otherwise."""
    parts = PurePosixPath(rel).parts
    return parts[0] if parts[0] in WHOLE_ROOTS or len(parts) == 1 else "/".join(parts[:-1])


def _excluded(name: str) -> bool:
    return name.startswith(STAGING_PREFIX) or name.endswith((".lock", ".tmp")) or name == "locks"


def scan(roots: dict[str, Path]) -> Iterator[tuple[str, Path]]:
    """(relative name, path) of every artifact file; locks, temp and staging files and links left out."""
    for name, root in roots.items():
        if root.is_symlink():
            continue
        if root.is_file():
            yield name, root
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not _excluded(d))
            for file in sorted(filenames):
                path = Path(dirpath) / file
                if not _excluded(file) and not path.is_symlink() and path.is_file():
                    yield f"{name}/{path.relative_to(root).as_posix()}" if root != path else name, path


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str


@dataclass
class Part:
    """One pusher's index part, checked: its fingerprint, its entries' fingerprints, every path and hash."""

    key: str
    instance: str
    pushed_at: str
    entries: dict[str, ManifestEntry]
    files: list[RemoteFile]
    fields: dict[str, Any]


def parse_part(key: str, data: Any, fingerprint: str, secret: str) -> Part:
    """Refuse a part that is not signed with `secret`, is not for `fingerprint` or names anything unsafe;
    `BadObject` says why."""
    check_signature(secret, data)
    if not isinstance(data, dict) or data.get("version") != INDEX_VERSION:
        raise BadObject(f"index version {data.get('version') if isinstance(data, dict) else None!r} is unknown")
    fields = data.get("fields")
    if data.get("fingerprint") != fingerprint or not isinstance(fields, dict) or fingerprint_of(fields) != fingerprint:
        raise BadObject(f"index is for fingerprint {data.get('fingerprint')!r}, not {fingerprint}")
    entries = {}
    for name, raw in (data.get("entries") or {}).items():
        entry = ManifestEntry(**raw)
        if entry.fingerprint != fingerprint or entry.resolution != name:
            raise BadObject(f"manifest entry {name!r} is for fingerprint {entry.fingerprint!r}")
        entries[name] = entry
    files = []
    for raw in data.get("files") or []:
        rel, size, sha = raw.get("path"), raw.get("size"), raw.get("sha256")
        pure = PurePosixPath(rel) if isinstance(rel, str) else None
        if pure is None or pure.is_absolute() or "\\" in rel or any(p in ("..", ".", "") for p in rel.split("/")):
            raise BadObject(f"unsafe path {rel!r}")
        if not isinstance(size, int) or size < 0 or not isinstance(sha, str) or not SHA256.match(sha):
            raise BadObject(f"bad size or sha256 for {rel!r}")
        files.append(RemoteFile(rel, size, sha))
    return Part(key, str(data.get("instance", "")), str(data.get("pushed_at", "")), entries, files, fields)


@dataclass
class Merged:
    files: dict[str, RemoteFile] = field(default_factory=dict)
    entries: dict[str, ManifestEntry] = field(default_factory=dict)
    parts: int = 0
    pushed_at: str = ""


def merge(parts: list[Part]) -> Merged:
    """Every reader merges the same parts the same way: older pushes first, the newest wins a path or a shape."""
    merged = Merged(parts=len(parts))
    for part in sorted(parts, key=lambda p: (p.pushed_at, p.instance)):
        merged.files.update({f.path: f for f in part.files})
        merged.entries.update(part.entries)
        merged.pushed_at = max(merged.pushed_at, part.pushed_at)
    return merged


def read_parts(
    store: Store, fingerprint: str, problems: list[str], secret: str, listing: list[Any] | None = None
) -> list[Part]:
    """The fingerprint's valid, signed index parts; a bad part is a one-line problem, not an error."""
    parts = []
    for listed in store.list(fingerprint, "index") if listing is None else listing:
        try:
            parts.append(parse_part(listed.key, store.get_json(listed.key), fingerprint, secret))
        except (BadObject, ValueError, TypeError, AttributeError) as exc:
            problems.append(f"index {listed.key} ignored: {' '.join(str(exc).split())[:200]}")
    return parts
