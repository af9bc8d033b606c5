"""The invisible watermark: 48 bits in the luminance at a fixed working size, read back after JPEG and resizing.

invisible-watermark's dwtDct (the first method) moved the largest DCT coefficient of 4x4 blocks at full
resolution, in the chroma: a JPEG re-encode at quality 90 or a 0.5x resize erased it, and it cost about 0.36 s
per 1024x1024 image with its read-back. Here (`METHOD` "lumaQim"):

- the luminance is shrunk to `WORK` x `WORK` (area average); in each 8x8 block of it one low DCT coefficient
  is quantised onto one of two interleaved lattices (QIM, step `STEP`): which lattice is the bit. The 48 bits
  are each repeated over about 21 blocks spread by a fixed permutation, and read by a soft majority vote, so a
  few damaged blocks (clipped highlights, a crop's edge, JPEG noise) do not change the payload;
- only the change is brought back to full size (bilinear) and added equally to R, G and B (a pure luminance
  change, at most about 1.3 levels, smooth at the scale of the image): the mark lives at the frequencies that
  JPEG keeps and that survive any resize down to `WORK`;
- reading shrinks the image to `WORK` x `WORK` the same way and votes, whatever its size now (0.5x or 2x).

Measured (BENCHMARKS.md, "Watermark", scripts/watermark_bench.py): cost and robustness per method, attack and
size. A solid colour holds it too (QIM needs no texture), except where the pixels are clipped at 0 or 255.
"""

from __future__ import annotations

import functools
from typing import Any

METHOD = "lumaQim"
BITS = 48
#: The working side: every image of at least this size (on both sides) is marked and read at WORK x WORK.
WORK = 256
BLOCK = 8
#: The coefficient of each 8x8 block that carries a bit (row, column): low, so resizing and JPEG keep it.
COEFFICIENT = (1, 2)
#: The QIM step in luminance units of the orthonormal DCT: the two lattices are STEP/2 apart.
STEP = 12.0
#: How many times the change is refined against what a reader will see (the round trip through full size).
PASSES = 2


@functools.cache
def _layout() -> tuple[Any, Any, Any]:
    """The DCT matrix, the block basis of COEFFICIENT, and each block's bit (a fixed permutation)."""
    import numpy as np

    n = np.arange(BLOCK)
    dct = np.sqrt(2.0 / BLOCK) * np.cos(np.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * BLOCK))
    dct[0] /= np.sqrt(2.0)
    u, v = COEFFICIENT
    basis = np.outer(dct[u], dct[v]).astype(np.float32)  # the pixel pattern of one unit of that coefficient
    blocks = (WORK // BLOCK) ** 2
    order = np.random.default_rng(0x464C5558).permutation(blocks) % BITS  # block -> which bit it carries
    return dct.astype(np.float32), basis, order


def fits(width: int, height: int) -> bool:
    return min(width, height) >= WORK


def _shrink(plane: Any) -> Any:
    import cv2

    if plane.shape == (WORK, WORK):
        return plane
    return cv2.resize(plane, (WORK, WORK), interpolation=cv2.INTER_AREA)


def _coefficients(small: Any) -> Any:
    """COEFFICIENT of every 8x8 block of a WORK x WORK plane, as a (blocks,) vector."""
    import numpy as np

    _, basis, _ = _layout()
    side = WORK // BLOCK
    tiles = small.reshape(side, BLOCK, side, BLOCK)
    return np.einsum("aybx,yx->ab", tiles, basis).reshape(-1)


def _change(small: Any, bits: Any) -> Any:
    """The WORK x WORK luminance change that puts each block's coefficient on its bit's lattice."""
    import numpy as np

    _, basis, order = _layout()
    coefficient = _coefficients(small)
    offset = bits[order] * (STEP / 2)
    target = np.round((coefficient - offset) / STEP) * STEP + offset
    side = WORK // BLOCK
    delta = (target - coefficient).reshape(side, side)
    return np.einsum("ab,yx->aybx", delta, basis).reshape(WORK, WORK).astype(np.float32)


def embed(image: Any, payload: bytes) -> Any:
    """`image` (PIL, at least WORK x WORK) with the 48 bits of `payload` in its luminance."""
    import cv2
    import numpy as np
    from PIL import Image

    bits = np.unpackbits(np.frombuffer(payload.ljust(BITS // 8, b"\0")[: BITS // 8], dtype=np.uint8))
    rgb = np.asarray(image.convert("RGB"))
    height, width = rgb.shape[:2]
    native = (height, width) == (WORK, WORK)

    def grow(plane: Any) -> Any:
        return plane if native else cv2.resize(plane, (width, height), interpolation=cv2.INTER_LINEAR)

    small = _shrink(cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY).astype(np.float32))
    total = np.zeros((WORK, WORK), dtype=np.float32)
    seen = small
    for _ in range(PASSES):  # each pass corrects what the trip to full size and back (the reader's view) blurred
        total += _change(seen, bits)
        seen = small + (total if native else _shrink(grow(total)))
    delta = np.rint(grow(total)).astype(np.int16)
    marked = cv2.add(rgb.astype(np.int16), cv2.merge([delta, delta, delta]))
    return Image.fromarray(np.clip(marked, 0, 255).astype(np.uint8))


def read(image: Any) -> bytes | None:
    """The 48 bits in `image`'s luminance as bytes (whatever they are), or None when it is too small."""
    import numpy as np

    if not fits(*image.size):
        return None
    _, _, order = _layout()
    import cv2

    gray = cv2.cvtColor(np.asarray(image.convert("RGB")), cv2.COLOR_RGB2GRAY).astype(np.float32)
    coefficient = _coefficients(_shrink(gray))
    # +1 on bit 0's lattice, -1 on bit 1's: summed over each bit's blocks, the sign is the bit.
    soft = np.cos(2 * np.pi * coefficient / STEP)
    votes = np.bincount(order, weights=soft, minlength=BITS)
    return bytes(np.packbits((votes < 0).astype(np.uint8)))
