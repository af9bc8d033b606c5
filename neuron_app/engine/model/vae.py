"""VAE decode in fixed-size latent tiles: one compiled decoder graph for every image shape.

A compiler with static shapes (Neuron) builds one graph per input shape. Decoding the whole latent
makes every resolution (and each orientation of it) a new VAE graph, and a 1024x1024 FLUX.2 decode
as one graph is beyond the Neuron compiler's instruction limit. Here every tile has the same shape:
tiles step across the latent with an overlap, the last tile of a row or column is moved back to
end at the edge, and a latent smaller than a tile is padded up to it (edge-replicated). Tiles are
blended with linear ramps across their overlaps. diffusers' own `tiled_decode` leaves edge tiles
smaller (a new shape per resolution), so this is our own loop around the real decoder module.

The hook replaces `vae.decode` on the instance, so the pipeline's unpacking, batch-norm
de-normalization and post-processing stay the pipeline's own.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TileSpec:
    """Tile side and overlap in latent pixels (one latent pixel = 8 image pixels for FLUX.2)."""

    tile: int
    overlap: int

    def __post_init__(self) -> None:
        if self.tile < 1 or not 0 <= 2 * self.overlap <= self.tile:
            raise ValueError(f"tile {self.tile} and overlap {self.overlap}: need tile >= 1 and 0 <= overlap <= tile/2")

    def starts(self, length: int) -> list[int]:
        """Tile origins along one axis of `length` latent pixels; the last tile ends at the edge."""
        if length <= self.tile:
            return [0]
        stride = self.tile - self.overlap
        starts = list(range(0, length - self.tile, stride))
        starts.append(length - self.tile)
        return starts

    def count(self, height: int, width: int) -> int:
        """Tiles decoded for a latent of `height` x `width`."""
        return len(self.starts(height)) * len(self.starts(width))


def _ramp(torch: Any, size: int, start: int, end: int, prev_end: int | None, next_start: int | None) -> Any:
    """1-D blend weights of a tile covering [start, end): ramps up over the overlap with the previous
    tile and down over the overlap with the next one; positive everywhere so every pixel is covered."""
    weight = torch.ones(size, dtype=torch.float32)
    if prev_end is not None and prev_end > start:
        n = prev_end - start
        weight[:n] = torch.minimum(weight[:n], (torch.arange(n, dtype=torch.float32) + 1) / (n + 1))
    if next_start is not None and next_start < end:
        n = end - next_start
        weight[size - n :] = torch.minimum(
            weight[size - n :], torch.flip((torch.arange(n, dtype=torch.float32) + 1) / (n + 1), [0])
        )
    return weight


def _axis_weights(torch: Any, starts: list[int], tile: int, scale: int) -> list[Any]:
    """Per-tile weights along one axis, in image pixels."""
    out = []
    for i, s in enumerate(starts):
        prev_end = (starts[i - 1] + tile) * scale if i > 0 else None
        next_start = starts[i + 1] * scale if i + 1 < len(starts) else None
        out.append(_ramp(torch, tile * scale, s * scale, (s + tile) * scale, prev_end, next_start))
    return out


class TiledDecoder:
    """Decodes latents tile by tile through one (optionally compiled) function of a fixed input shape."""

    def __init__(self, vae: Any, spec: TileSpec, backend: Any | None = None) -> None:
        self.vae = vae
        self.spec = spec
        self.tiles_decoded = 0
        self.compiled = backend is not None
        fn = self._decode_tile
        if backend is not None:
            import torch

            fn = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
        self._tile_fn = fn

    def _decode_tile(self, z: Any) -> Any:
        if self.vae.post_quant_conv is not None:
            z = self.vae.post_quant_conv(z)
        return self.vae.decoder(z)

    def decode(self, z: Any, return_dict: bool = True, generator: Any = None) -> Any:
        """Same contract as `AutoencoderKLFlux2.decode`: `(sample,)` or a `DecoderOutput`."""
        import torch
        import torch.nn.functional as F

        batch, _, height, width = z.shape
        tile = self.spec.tile
        pad_h, pad_w = max(0, tile - height), max(0, tile - width)
        if pad_h or pad_w:
            z = F.pad(z, (0, pad_w, 0, pad_h), mode="replicate")
        rows, cols = self.spec.starts(z.shape[2]), self.spec.starts(z.shape[3])
        # Tiles are blended on the host: the image goes there for PIL anyway, and a device must not take
        # in-place writes into strided slices (TorchNeuron refuses non-contiguous outputs), nor compile the
        # canvas-sized blend ops once per resolution.
        out: Any = None
        total: Any = None
        scale = 0
        row_w: list[Any] = []
        col_w: list[Any] = []
        for ri, r in enumerate(rows):
            for ci, c in enumerate(cols):
                # A fresh copy: a view's strides depend on the latent's shape, and the compiled graph guards on them.
                piece = self._tile_fn(z[:, :, r : r + tile, c : c + tile].clone(memory_format=torch.contiguous_format))
                piece = piece.float().cpu()
                self.tiles_decoded += 1
                if out is None:
                    scale = piece.shape[-1] // tile
                    out = torch.zeros((batch, piece.shape[1], z.shape[2] * scale, z.shape[3] * scale))
                    total = torch.zeros((1, 1, out.shape[2], out.shape[3]))
                    row_w = _axis_weights(torch, rows, tile, scale)
                    col_w = _axis_weights(torch, cols, tile, scale)
                weight = row_w[ri][:, None] * col_w[ci][None, :]
                ys, xs = slice(r * scale, (r + tile) * scale), slice(c * scale, (c + tile) * scale)
                out[:, :, ys, xs] += piece * weight
                total[:, :, ys, xs] += weight
        image = (out / total)[:, :, : height * scale, : width * scale].to(z.dtype)
        if not return_dict:
            return (image,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=image)


def install_tiled_decode(pipe: Any, spec: TileSpec, backend: Any | None) -> TiledDecoder:
    """Route `pipe.vae.decode` through a `TiledDecoder`; the pipeline's post-processing is untouched."""
    decoder = TiledDecoder(pipe.vae, spec, backend)
    pipe.vae.decode = decoder.decode
    log.info("VAE decode tiled: %d latent px tiles, overlap %d, compiled=%s", spec.tile, spec.overlap, bool(backend))
    return decoder


def vae_compiled(setting: str, by_default: bool) -> bool:
    """Whether the VAE decodes in compiled tiles: `auto` means where the backend says so (Neuron).

    Elsewhere the eager VAE costs nothing per shape (CPU and CUDA run eager ops without compiling them),
    so compiling it would add one compile and buy little; `on` is there to measure and test it.
    """
    return setting == "on" or (setting == "auto" and by_default)


class HostDecoder:
    """`vae_device = "cpu"`: decode on the host, in float32, with the VAE's decoder moved there.

    The encoder stays on the device (references of an edit are encoded there), so the VAE still reports
    the device and the pipeline's execution device is unchanged. Measured elsewhere (a public klein-4B
    port): a 1024x1024 decode on the host took about 2.9 s, where neuronx-cc refused the whole-image graph.
    """

    def __init__(self, vae: Any) -> None:
        import torch

        self.vae = vae
        self.modules = tuple(m for m in (vae.post_quant_conv, vae.decoder) if m is not None)
        for module in self.modules:
            module.to(device="cpu", dtype=torch.float32)

    def decode(self, z: Any, return_dict: bool = True, generator: Any = None) -> Any:
        import torch

        with torch.inference_mode():
            z = z.float().cpu()
            if self.vae.post_quant_conv is not None:
                z = self.vae.post_quant_conv(z)
            image = self.vae.decoder(z)
        if not return_dict:
            return (image,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=image)


def install_host_decode(pipe: Any) -> HostDecoder:
    decoder = HostDecoder(pipe.vae)
    pipe.vae.decode = decoder.decode
    log.info("VAE decode on the host (float32); the encoder stays on the device")
    return decoder


def vae_backend(compile_backend: str) -> str:
    """The backend for the tile graph: the transformer's, except aot_eager -> eager (dynamo's graph, run as is).

    torch 2.13's aot_eager breaks this decoder (a `native_group_norm` after the mid-block attention gets a
    non-contiguous input: "Expected X.is_contiguous(memory_format)"); inductor and eager run it. Tests use
    aot_eager for speed, and the count of graphs is the same either way.
    """
    return "eager" if compile_backend == "aot_eager" else compile_backend


def psnr(a_image: Any, b_image: Any) -> float:
    """PSNR (dB) of two images of one size, each a PIL image or a file's path: how close a tiled (or any other)
    decode is to the reference."""
    import numpy as np
    from PIL import Image

    images = [Image.open(p) if isinstance(p, str) else p for p in (a_image, b_image)]
    a, b = (np.asarray(image.convert("RGB"), dtype=np.float64) for image in images)
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)
