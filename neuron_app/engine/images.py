"""Generated images on disk: PNG with how-it-was-made metadata, bounded in number."""

from __future__ import annotations

import json
import threading
import uuid
from collections import deque
from pathlib import Path
from typing import IO, Any

from neuron_app import __version__


class ImageStore:
    """Writes PNGs into one folder and keeps only the newest `keep`, so a demo cannot fill the disk."""

    def __init__(self, folder: Path, keep: int = 200) -> None:
        self.folder = folder
        self.keep = keep
        self._lock = threading.Lock()
        self._files: deque[Path] | None = None  # oldest first; read from the folder once, then kept here

    def save(self, record: Any) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{record.resolution}-{record.seed}-{uuid.uuid4().hex[:8]}.png"
        write_png(record, path)
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


def write_png(record: Any, target: Path | IO[bytes]) -> None:
    """The record's image as PNG with how it was made (prompt, seed, steps, size, model, LoRA) in text chunks."""
    from PIL.PngImagePlugin import PngInfo

    meta = PngInfo()
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
    if record.references:  # an edit: which references (buckets and hashes) made it
        fields["references"] = json.dumps([{"bucket": r["bucket"], "sha256": r["sha256"]} for r in record.references])
    for key, value in fields.items():
        meta.add_itxt(key, str(value))
    # compress_level 1: a 1024x1024 PNG encodes faster than at the default 6, for a somewhat larger file;
    # the encode runs inside every request's round trip.
    record.image.save(target, format="PNG", pnginfo=meta, compress_level=1)
