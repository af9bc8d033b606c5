"""A starting point for the shapes VAE: `AutoencoderKLFlux2` set by hand to 8x average pooling and back.

Trained from random weights, the real VAE class needs thousands of steps on flat colours before it even passes a
background through (its deep residual stacks and group norms); a CPU budget of minutes never gets there. So every
residual branch starts at zero (each block an identity), the down- and upsamplers average and repeat, and the group
norm before each `conv_out` is made harmless: each colour is carried with its negative and a large constant in
one group, so the group's mean is the constant and its spread nearly so, and a bias keeps SiLU in its linear part.
The latent is then the image averaged over 8x8 pixels (3 channels, the fourth zero), decoded as 8x8 blocks;
training (train.py) refines both from there.
"""

from __future__ import annotations

from typing import Any

#: The constant carried beside the colours through each group norm, and the bias that keeps SiLU linear.
CARRY = 20.0
LINEAR = 10.0


def _zero(module: Any) -> None:
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.zero_()


def _centre(conv: Any, pairs: list[tuple[int, int, float]], bias: dict[int, float] | None = None) -> None:
    """A conv that only passes input channel i to output channel o times w, at the kernel's centre."""
    import torch

    with torch.no_grad():
        conv.weight.zero_()
        k = conv.weight.shape[-1] // 2
        for out, inp, weight in pairs:
            conv.weight[out, inp, k, k] = weight
        if conv.bias is not None:
            conv.bias.zero_()
            for out, value in (bias or {}).items():
                conv.bias[out] = value


def _identity(conv: Any) -> None:
    n = min(conv.weight.shape[0], conv.weight.shape[1])
    _centre(conv, [(c, c, 1.0) for c in range(n)])


def _residuals_to_zero(block: Any) -> None:
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

    for module in block.modules():
        if isinstance(module, ResnetBlock2D):
            _zero(module.conv2)
            if module.conv_shortcut is not None:
                _identity(module.conv_shortcut)
        elif isinstance(module, Attention):
            _zero(module.to_out[0])


def _linear_norm(norm: Any, channels: int) -> None:
    import torch

    with torch.no_grad():
        norm.weight.fill_(1.0)
        norm.bias.zero_()
        norm.bias[:channels] = LINEAR


def _group_std(values: list[float], size: int) -> float:
    """The spread of a group holding `values` (colour 0, its negative 0, the constant) and zeros."""
    padded = values + [0.0] * (size - len(values))
    mean = sum(padded) / size
    return (sum((v - mean) ** 2 for v in padded) / size) ** 0.5


def average_pool_vae(vae: Any) -> None:
    """Set `vae` (4 levels, latent_channels >= 3, widths multiple of the groups) to pool and repeat 8x8 blocks."""
    import torch

    enc, dec = vae.encoder, vae.decoder
    groups = enc.conv_norm_out.num_groups
    latent = vae.config.latent_channels
    _residuals_to_zero(enc)
    _residuals_to_zero(dec)
    # Encoder: R, -R, G, -G, B, -B and the constant in the first group of every stage.
    _centre(enc.conv_in, [(2 * c + s, c, 1.0 - 2 * s) for c in range(3) for s in (0, 1)], {6: CARRY})
    for block in enc.down_blocks:
        for down in block.downsamplers or []:
            with torch.no_grad():
                down.conv.weight.zero_()
                down.conv.bias.zero_()
                for c in range(min(down.conv.weight.shape[:2])):
                    down.conv.weight[c, c, :2, :2] = 0.25  # the 2x2 window of a stride-2 conv: an average
    _linear_norm(enc.conv_norm_out, 7)
    size = enc.conv_norm_out.num_channels // groups
    std = _group_std([1.0, -1.0] * 3 + [CARRY], size)  # at |colour| = 1; the constant dominates, so ~any colour
    pairs = [(c, 2 * c, std / 2) for c in range(3)] + [(c, 2 * c + 1, -std / 2) for c in range(3)]
    _centre(enc.conv_out, pairs, {latent + c: -10.0 for c in range(latent)})  # log-variance: nearly certain
    if vae.quant_conv is not None:
        _identity(vae.quant_conv)
    # Decoder: colour c, its negative and the constant in group c of the last norm (so in channels 4c..4c+2).
    size = dec.conv_norm_out.num_channels // dec.conv_norm_out.num_groups
    assert size >= 3, "the decoder's last group norm needs three channels a group"
    layout = [(size * c + s, c, 1.0 - 2 * s) for c in range(3) for s in (0, 1)]
    _centre(dec.conv_in, layout, {size * c + 2: CARRY for c in range(3)})
    if vae.post_quant_conv is not None:
        _identity(vae.post_quant_conv)
    for block in dec.up_blocks:
        for up in block.upsamplers or []:
            _identity(up.conv)
    with torch.no_grad():
        dec.conv_norm_out.weight.fill_(1.0)
        dec.conv_norm_out.bias.zero_()
        for c in range(3):
            dec.conv_norm_out.bias[size * c : size * c + 3] = LINEAR
    std = _group_std([1.0, -1.0, CARRY], size)
    _centre(dec.conv_out, [(c, size * c, std / 2) for c in range(3)] + [(c, size * c + 1, -std / 2) for c in range(3)])
