"""Image shapes: parsing, validation and the key that decides whether a graph is reused.

Kept free of torch so that settings and request validation cost nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from neuron_app.errors import ShapeError

#: FLUX.2 packs 2x2 latent patches over a VAE of scale factor 8.
MULTIPLE = 16
#: Largest side accepted anywhere; FLUX.2-klein has been served up to 2048x2048.
MAX_SIDE = 4096

#: Exactly "WIDTHxHEIGHT": no sign, spaces, leading zeros or trailing newline (used with `fullmatch`).
_SHAPE_RE = re.compile(r"(0|[1-9][0-9]{0,4})x(0|[1-9][0-9]{0,4})")


@dataclass(frozen=True, order=True)
class Resolution:
    width: int
    height: int

    @classmethod
    def parse(cls, text: str) -> Resolution:
        """Parse a strict "WIDTHxHEIGHT" (lower-case x, no spaces): the one form the UI sends."""
        if not isinstance(text, str):
            raise ShapeError(f"resolution must be a string like '1024x1024', got {type(text).__name__}")
        match = _SHAPE_RE.fullmatch(text)
        if not match:
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise ShapeError(f"resolution {shown!r} is not of the form WIDTHxHEIGHT, e.g. '1024x1024'")
        width, height = int(match.group(1)), int(match.group(2))
        for side, value in (("width", width), ("height", height)):
            if value <= 0 or value % MULTIPLE:
                raise ShapeError(f"{side} {value} in {text!r} must be a positive multiple of {MULTIPLE}")
            if value > MAX_SIDE:
                raise ShapeError(f"{side} {value} in {text!r} is above the maximum of {MAX_SIDE}")
        return cls(width, height)

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def image_tokens(self) -> int:
        """Tokens the transformer sees; its compiled graph depends on this, not on orientation."""
        return (self.width // MULTIPLE) * (self.height // MULTIPLE)


@dataclass(frozen=True, order=True)
class GraphKey:
    """Everything about a request that changes what the device compiles for it.

    Two resolutions with the same token count (e.g. 1344x768 and 768x1344) share the transformer's
    graph: measured on CPU, the second one's first call compiles nothing. Where the device also
    compiles the eager parts per shape (Neuron compiles every op on first use, the VAE decoder's
    included), the orientation is part of the key: `layout` is then the resolution itself.

    An edit concatenates its references' tokens after the output's: `image_tokens` is then the total.
    Measured on CPU (tiny model): edits of one total share a graph whatever the split (64x64 + a 128x128
    reference = 128x128 + a 64x64 one) or the reference count, but never a text-to-image graph of the same
    total, hence `edit`. Per orientation, the layout names the output and the (sorted) reference buckets.
    """

    image_tokens: int
    batch_size: int
    max_sequence_length: int
    layout: str | None = None
    edit: bool = False

    @classmethod
    def for_shape(
        cls,
        res: Resolution,
        *,
        batch_size: int,
        max_sequence_length: int,
        per_orientation: bool = False,
        references: tuple[Resolution, ...] = (),
    ) -> GraphKey:
        tokens = res.image_tokens + sum(r.image_tokens for r in references)
        layout = "+".join([str(res), *sorted(str(r) for r in references)]) if per_orientation else None
        return cls(tokens, batch_size, max_sequence_length, layout, bool(references))

    def __str__(self) -> str:
        text = f"tokens={self.image_tokens},batch={self.batch_size},seq={self.max_sequence_length}"
        text += ",edit" if self.edit else ""
        return f"{text},layout={self.layout}" if self.layout else text
