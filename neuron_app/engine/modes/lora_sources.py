"""Where a configured LoRA adapter comes from (engine/modes/lora.py loads it): its source parsed, its file's
header and rank read, without torch and without reading the weights (cheap start-up checks)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_app.errors import LoraError
from neuron_app.settings import MODEL_DEFAULTS, shipped_model

#: Weight file diffusers saves a LoRA folder with (`save_lora_weights`).
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def tiny_rank(seed: int) -> int:
    """`tiny:<seed>` adapters have rank 4 (odd seeds) or 8 (even seeds): two ranks exercise the padding."""
    return 4 if seed % 2 else 8


@dataclass(frozen=True)
class AdapterSpec:
    """One configured adapter: where its weights come from, parsed without reading them."""

    name: str
    source: str  # as configured
    kind: str  # tiny | file | hub
    location: str  # tiny: the seed; file: an absolute .safetensors path; hub: the repo id
    weight_name: str | None = None

    @classmethod
    def parse(cls, name: str, source: str) -> AdapterSpec:
        """`tiny:<seed>`; a shipped model's style (`tiny-shapes:outline`); a `.safetensors` file; a folder
        (optionally `folder:weight.safetensors`); a Hub `owner/repo` (optionally `owner/repo:weight.safetensors`)."""
        text = source.strip()
        model, _, style = text.partition(":")
        if model in MODEL_DEFAULTS and style:
            path = shipped_model(model) / "lora" / f"{style}.safetensors"
            if not path.is_file():
                raise LoraError(f"LoRA {name!r}: {model} ships no style {style!r}")
            return cls(name, source, "file", str(path))
        if text.startswith("tiny:"):
            seed = text.removeprefix("tiny:")
            if not seed.isdigit():
                raise LoraError(f"LoRA {name!r}: source {source!r}: tiny adapters are written tiny:<seed>, e.g. tiny:1")
            return cls(name, source, "tiny", seed)
        base, _, weight = text.rpartition(":") if text.endswith(".safetensors") and ":" in text else (text, "", "")
        base, weight = (base, weight) if base else (text, "")
        path = Path(base).expanduser()
        if path.is_absolute() or base.startswith(".") or path.exists():
            if path.is_dir():
                path = path / (weight or DEFAULT_WEIGHT_NAME)
            elif weight:
                raise LoraError(f"LoRA {name!r}: {path} is not a folder, so it cannot hold {weight}")
            if not path.is_file():
                raise LoraError(f"LoRA {name!r}: file {path} does not exist")
            if path.suffix != ".safetensors":
                raise LoraError(f"LoRA {name!r}: {path} is not a .safetensors file (pickled weights are refused)")
            return cls(name, source, "file", str(path.resolve()))
        if base.count("/") != 1:
            raise LoraError(
                f"LoRA {name!r}: source {source!r} is neither an existing path, a Hub id (owner/repo) nor tiny:<seed>"
            )
        return cls(name, source, "hub", base, weight or None)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor names and shapes of a .safetensors file, without torch and without reading the weights."""
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError("file is too short to be safetensors")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 2**20:
            raise ValueError(f"header of {size} bytes is not plausible")
        header = json.loads(fh.read(size))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def header_rank(header: dict[str, Any]) -> int:
    """The largest LoRA rank in a header: dim 0 of the down/A matrices (diffusers, peft and kohya names)."""
    ranks = [
        int(info["shape"][0])
        for key, info in header.items()
        if (".lora_A." in key or ".lora_down." in key) and len(info.get("shape", [])) >= 2
    ]
    if not ranks:
        raise ValueError("no LoRA matrices (lora_A / lora_down) in it")
    return max(ranks)
