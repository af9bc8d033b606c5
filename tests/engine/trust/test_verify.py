"""`verify` tells proof from claims (neuron_app/verify.py): only a valid C2PA manifest of this server's certificate
that binds the bytes says "made by"; each forgery an attacker can make with public tools reads as a claim.

The genuine image comes from the real `Marker` (watermark, XMP, C2PA with a local chain); the forgeries are made
with the public libraries (Pillow's PngInfo for the XMP, invisible-watermark for the payload, c2pa-python with
another chain of the same names), and the pixel swap by PNG chunk surgery that keeps the manifest.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from neuron_app.engine.trust.marks import XMP_KEY
from neuron_app.verify import EXIT_CLAIMED, EXIT_MARKED, Report, configured_signer, verify_file

PAYLOAD = b"FLUX2K"


def noise(seed: int, size: int = 256) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def marked_png(settings: Any, seed: int) -> bytes:
    from neuron_app.engine.records import CacheResult, GenerationRecord
    from neuron_app.engine.trust.marks import Marker

    record = GenerationRecord(
        "256x256", 2, seed, "a marked lighthouse", CacheResult.MISS, False, 0.0, 0.0, 0.0, 0, "tiny",
        image=noise(seed),
    )  # fmt: skip
    return Marker(settings).encode(record, {"prompt": record.prompt, "model": "tiny"})


def chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(png):
        (size,) = struct.unpack(">I", png[pos : pos + 4])
        out.append((png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + size]))
        pos += 12 + size
    return out


def assemble(parts: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(struct.pack(">I", len(d)) + k + d + struct.pack(">I", zlib.crc32(k + d)) for k, d in parts)
    return b"\x89PNG\r\n\x1a\n" + body


@pytest.fixture
def server(make_settings: Callable[..., Any], tmp_path: Path) -> Any:
    settings = make_settings()
    genuine = tmp_path / "genuine.png"
    genuine.write_bytes(marked_png(settings, 1))
    return settings, genuine


def check(settings: Any, path: Path) -> Report:
    return verify_file(path, PAYLOAD, configured_signer(settings))


def test_a_genuine_image_is_made_by_this_server(server: Any) -> None:
    settings, genuine = server
    report = check(settings, genuine)
    assert report.proof and report.ours == ["c2pa", "iptc", "watermark"], report.lines
    assert report.verdict.startswith("made by neuron-app (a valid C2PA manifest binds these bytes")
    assert "validation Trusted" in report.lines[0]


def test_a_copied_xmp_on_an_unrelated_image_is_a_claim(server: Any, tmp_path: Path) -> None:
    settings, genuine = server
    source = Image.open(genuine)
    info = PngInfo()
    for key, value in source.text.items():  # every text chunk, the XMP with its CreatorTool among them
        info.add_itxt(key, value)
    forged = tmp_path / "copied-xmp.png"
    noise(7).save(forged, pnginfo=info)
    assert XMP_KEY in Image.open(forged).info
    report = check(settings, forged)
    assert not report.proof and report.claims == ["iptc"], report.lines
    assert report.verdict == "carries an AI-generated claim (not proof of origin): iptc"


def test_a_public_library_watermark_is_a_claim(server: Any, tmp_path: Path) -> None:
    """FLUX2K written with invisible-watermark's dwtDct (the library this server used before) and with this
    server's own open method (engine/trust/watermark.py, public code): neither is proof."""
    from imwatermark import WatermarkDecoder, WatermarkEncoder

    from neuron_app.engine.trust import watermark

    settings, _ = server
    encoder = WatermarkEncoder()
    encoder.set_watermark("bytes", PAYLOAD)
    bgr = np.ascontiguousarray(np.asarray(noise(8))[:, :, ::-1])
    for _ in range(2):  # as the library's own users would, until it reads back
        bgr = np.clip(encoder.encode(bgr, "dwtDct"), 0, 255).astype(np.uint8)
    assert bytes(WatermarkDecoder("bytes", 48).decode(bgr, "dwtDct")) == PAYLOAD
    library = tmp_path / "dwtdct.png"
    Image.fromarray(bgr[:, :, ::-1].copy()).save(library)
    ours = tmp_path / "lumaqim.png"
    watermark.embed(noise(8), PAYLOAD).save(ours)
    for forged, claims in ((library, []), (ours, ["watermark"])):
        report = check(settings, forged)
        assert not report.proof and report.claims == claims, report.lines
        assert "made by" not in report.verdict
    assert "not proof of origin" in check(settings, ours).verdict


def test_a_genuine_manifest_with_swapped_pixels_is_a_claim(server: Any, tmp_path: Path) -> None:
    settings, genuine = server
    other = io.BytesIO()
    noise(9).save(other, format="PNG", compress_level=1)
    new_pixels = [c for c in chunks(other.getvalue()) if c[0] == b"IDAT"]
    parts, swapped = [], False
    for kind, data in chunks(genuine.read_bytes()):
        if kind != b"IDAT":
            parts.append((kind, data))
        elif not swapped:
            parts.extend(new_pixels)
            swapped = True
    forged = tmp_path / "swapped.png"
    forged.write_bytes(assemble(parts))
    assert Image.open(forged).text == Image.open(genuine).text  # same manifest, XMP and text; other pixels
    report = check(settings, forged)
    assert not report.proof and "validation Invalid" in report.lines[0], report.lines
    assert report.claims == ["c2pa", "iptc"] and "changed after signing" in report.verdict


def test_a_manifest_signed_by_another_chain_of_the_same_names_is_a_claim(
    server: Any, make_settings: Callable[..., Any], tmp_path: Path
) -> None:
    """An attacker's own local chain (same subject names, its own keys) signs the same manifest: valid for its
    bytes, but it does not chain to this server's anchor."""
    settings, _ = server
    attacker = make_settings(cache_dir=tmp_path / "attacker")
    forged = tmp_path / "other-signer.png"
    forged.write_bytes(marked_png(attacker, 1))
    report = check(settings, forged)
    assert not report.proof and report.claims == ["c2pa", "iptc", "watermark"], report.lines
    assert "not signed by this server's certificate" in report.verdict
    assert check(attacker, forged).proof  # its own server would call it its own


def test_the_command_exits_3_for_claims_and_0_for_proof(server: Any, tmp_path: Path, capsys: Any) -> None:
    from neuron_app.__main__ import main
    from neuron_app.settings import get_settings

    settings, genuine = server
    stripped = tmp_path / "stripped.png"
    Image.open(genuine).convert("RGB").save(stripped)  # only the watermark is left
    saved = os.environ.get("NEURON_APP_CACHE_DIR")
    os.environ["NEURON_APP_CACHE_DIR"] = str(settings.cache_dir)
    get_settings.cache_clear()
    try:
        assert main(["verify", str(genuine)]) == EXIT_MARKED
        assert main(["verify", str(genuine), str(stripped)]) == EXIT_CLAIMED
    finally:
        os.environ.pop("NEURON_APP_CACHE_DIR")
        if saved is not None:
            os.environ["NEURON_APP_CACHE_DIR"] = saved
        get_settings.cache_clear()
    out = capsys.readouterr().out
    assert "verdict: carries an AI-generated claim (not proof of origin): watermark" in out


def test_a_decompression_bomb_is_unreadable_not_a_traceback(tmp_path: Path, capsys: Any) -> None:
    """Issue 45, row 51: a 274-byte PNG whose header says 20000x20000 is `unreadable` (exit 2), as a bad file is."""
    from neuron_app.__main__ import main
    from neuron_app.verify import EXIT_UNREADABLE

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 0, 0, 0, 0)
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)))
    bomb.write_bytes(bomb.read_bytes() + chunk(b"IEND", b""))
    assert main(["verify", str(bomb)]) == EXIT_UNREADABLE
    assert "DecompressionBombError" in capsys.readouterr().out
