"""Generated images on disk: PNG with how-it-was-made metadata, bounded in number."""

from __future__ import annotations

import json
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from neuron_app import __version__, tracing
from neuron_app.engine.trust.marks import Marker


class ImageStore:
    """Writes PNGs into one folder and keeps only the newest `keep`, so a demo cannot fill the disk."""

    def __init__(self, folder: Path, keep: int = 200, marker: Marker | None = None) -> None:
        self.folder = folder
        self.keep = keep
        self.marker = marker
        self._lock = threading.Lock()
        self._files: deque[Path] | None = None  # oldest first; read from the folder once, then kept here

    def save(self, record: Any) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{record.resolution}-{record.seed}-{uuid.uuid4().hex[:8]}.png"
        write_png(record, path, self.marker)
        self._prune(path)
        return path

    def _prune(self, new: Path) -> None:
        """Drop the oldest beyond `keep`; the folder is listed once per process, not on every save."""
        with self._lock:
            if self._files is None:
                listed = sorted(self.folder.glob("*.png"), key=lambda p: p.stat().st_mtime)
                self._files = deque(p for p in listed if p != new)
            self._files.append(new)
            while len(self._files) > self.keep:
                self._files.popleft().unlink(missing_ok=True)


def provenance(record: Any) -> dict[str, str]:
    """How the image was made (prompt, seed, steps, size, model, LoRA): the PNG's text chunks."""
    fields = {
        "prompt": record.prompt,
        "seed": record.seed,
        "steps": record.steps,
        "size": record.resolution,
        "model": record.model,
        "lora": record.lora,
        "lora_scale": record.lora_scale,
        "software": f"neuron-app {__version__}",
    }
    if len(record.loras) > 1:  # several styles: all of them (lora and lora_scale name the first)
        fields["loras"] = json.dumps(record.loras)
    if record.references:  # an edit: which references (buckets and hashes) made it
        fields["references"] = json.dumps([{"bucket": r["bucket"], "sha256": r["sha256"]} for r in record.references])
    if record.source:  # image-to-image or inpainting: which image, how much of it was redrawn
        fields["source"] = json.dumps(record.source)
    return {key: str(value) for key, value in fields.items()}


def write_png(record: Any, target: Path | IO[bytes], marker: Marker | None = None) -> None:
    """The record's image as PNG with its provenance, marked as AI-made (engine/trust/marks.py: watermark, IPTC XMP,
    signed C2PA manifest); `marker` None: the process settings' marker. `record.marks` says what it carries."""
    write_image(record, target, marker)


def write_image(
    record: Any, target: Path | IO[bytes], marker: Marker | None = None, fmt: str = "png", quality: int | None = None
) -> None:
    """`encoded` written to `target` (a path or a binary file)."""
    data = encoded(record, marker, fmt, quality)
    if isinstance(target, Path):
        target.write_bytes(data)
    else:
        target.write(data)


def encoded(record: Any, marker: Marker | None = None, fmt: str = "png", quality: int | None = None) -> bytes:
    """The record's marked, signed file as `fmt` (png, jpeg, webp): the one the post-processing stage made
    (engine/output/postprocess.py) when it is of this image, format and marker, else made now."""
    if marker is None:
        from neuron_app.settings import get_settings

        marker = Marker.for_settings(get_settings())
    made = getattr(record, "encoded", None)
    if made is not None and made.fits(record.image, marker, fmt, quality):
        record.marks = dict(made.marks)
        return made.data
    with tracing.span("marks", format=fmt):
        data = marker.encode(record, provenance(record), fmt, quality)
    record.encoded = Encoded(record.image, marker.identity, fmt, quality, data, dict(record.marks))
    return data


@dataclass(frozen=True)
class Encoded:
    """One encode of a record's image: what it was made from and how, the bytes, and the marks they carry. Kept on
    the record as a plain attribute (not a field: `info` and `dataclasses.replace` leave it out)."""

    image: Any = field(repr=False, compare=False)
    marker: str  # Marker.identity: a replica's encode serves its caller under the same configuration
    fmt: str
    quality: int | None
    data: bytes = field(repr=False)
    marks: dict[str, str]

    def fits(self, image: Any, marker: Any, fmt: str, quality: int | None) -> bool:
        """The same pixels (not resized since: `fit_record` makes a new image), marker, format and quality."""
        same = (marker.identity, fmt, quality) == (self.marker, self.fmt, self.quality)
        return image is self.image and same
