"""AI-content marks on every image (engine/trust/marks.py) and `python -m neuron_app verify`.

Real libraries end to end: a 256x256 image of the launched tiny app from gradio_client's `/generate` and from
the OpenAI SDK (`b64_json` and `url`) carries a C2PA manifest that c2pa.Reader reads and validates, the IPTC
digital source type in its XMP, and the FLUX2K watermark (lumaQim), which reads back after a JPEG re-encode at
quality 90 and a 0.5x resize; `verify` says so (exit 0), finds nothing on a plain PNG (1) and refuses garbage
(2), without a traceback.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from neuron_app.engine.trust.marks import DIGITAL_SOURCE_TYPE, XMP_KEY, embed_watermark, read_watermark
from tests.support import ROOT, mcp_image

SHAPES = ["64x64", "256x256"]
PAYLOAD = b"FLUX2K"


def c2pa_manifest(data: bytes) -> tuple[dict[str, Any], str]:
    import c2pa

    with c2pa.Reader("image/png", io.BytesIO(data)) as reader:
        return reader.get_active_manifest(), reader.get_validation_state()


def assert_marked(data: bytes) -> None:
    """C2PA (readable, valid, a c2pa.created AI action), IPTC XMP, the FLUX2K watermark; provenance text stays."""
    manifest, state = c2pa_manifest(data)
    assert state in ("Valid", "Trusted")  # the local chain validates; it is untrusted, not invalid
    actions = next(a for a in manifest["assertions"] if a["label"].startswith("c2pa.actions"))["data"]["actions"]
    created = next(a for a in actions if a["action"] == "c2pa.created")
    assert created["digitalSourceType"] == DIGITAL_SOURCE_TYPE and "trainedAlgorithmicMedia" in str(manifest)
    assert created["softwareAgent"]["name"] == "neuron-app" and created["parameters"]["model"] == "tiny"
    image = Image.open(io.BytesIO(data))
    image.load()
    assert f'Iptc4xmpExt:DigitalSourceType="{DIGITAL_SOURCE_TYPE}"' in image.info[XMP_KEY]
    assert image.text["prompt"] == "a marked lighthouse" and image.text["model"] == "tiny"
    assert read_watermark(image) == PAYLOAD


def jpeg(image: Image.Image, quality: int = 90) -> Image.Image:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def retext(png: bytes, old: bytes, new: bytes) -> bytes:
    """`png` with `old` replaced in its text chunks, CRCs recomputed: a valid PNG changed after signing."""
    import struct
    import zlib

    out, pos = bytearray(png[:8]), 8
    while pos < len(png):
        (size,) = struct.unpack(">I", png[pos : pos + 4])
        kind, body = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + size]
        body = body.replace(old, new) if kind == b"iTXt" else body
        out += struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        pos += 12 + size
    return bytes(out)


def verify(capsys: pytest.CaptureFixture[str], cache_dir: Path, *files: Any) -> int:
    """`python -m neuron_app verify` in this process (its argument parser and exit status), with the settings of
    the server whose chain it checks against (its cache folder holds the local chain)."""
    from neuron_app.__main__ import main
    from neuron_app.settings import get_settings

    capsys.readouterr()
    os.environ["NEURON_APP_CACHE_DIR"] = str(cache_dir)
    get_settings.cache_clear()
    try:
        return main(["verify", *map(str, files)])
    finally:
        del os.environ["NEURON_APP_CACHE_DIR"]
        get_settings.cache_clear()


def run_verify(cache_dir: Path, *files: Any) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    env["NEURON_APP_CACHE_DIR"] = str(cache_dir)
    return subprocess.run(
        [sys.executable, "-m", "neuron_app", "verify", *map(str, files)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


@pytest.fixture(scope="module")
def marked_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(resolutions=SHAPES, default_resolution="64x64")


@pytest.mark.parametrize("side", [256, 512, 1024])
def test_the_watermark_reads_back_after_jpeg_q90_and_a_half_size_resize(side: int) -> None:
    """On noise (what the tiny model draws), photo-like content and a flat colour: the payload reads back from the
    marked image, from its JPEG at quality 90 and, from 512x512 up, from a 0.5x resize (bilinear and area) and
    the JPEG of that; images under 256 px are not even tried. One limit, measured: white noise halved to exactly
    the 256 px working size with another filter than the embedder's (bilinear) aliases differently and loses
    the bits; at 1024 (halved to 512, then averaged to 256 on reading) it holds."""
    rng = np.random.default_rng(side)
    detail = rng.integers(0, 256, (side // 16, side // 16, 3), dtype=np.uint8)
    contents = {
        "noise": Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)),
        "photo-like": Image.fromarray(detail).resize((side, side), Image.Resampling.BICUBIC),
        "flat": Image.new("RGB", (side, side), (90, 140, 200)),
    }
    for kind, image in contents.items():
        marked = embed_watermark(image, PAYLOAD)
        assert marked is not None and read_watermark(marked) == PAYLOAD, kind
        assert read_watermark(jpeg(marked)) == PAYLOAD, (kind, "jpeg q90")
        if side >= 1024 or (side >= 512 and kind != "noise"):
            for resample in (Image.Resampling.BILINEAR, Image.Resampling.BOX):
                half = marked.resize((side // 2, side // 2), resample)
                assert read_watermark(half) == PAYLOAD and read_watermark(jpeg(half)) == PAYLOAD, (kind, resample)
        assert read_watermark(image) != PAYLOAD  # the unmarked image does not read as marked
    assert read_watermark(Image.new("RGB", (128, 512))) is None  # under 256 on one side: not even tried


def test_a_clipped_image_says_it_holds_no_watermark(make_settings: Callable[..., Any]) -> None:
    """Pure white has no room to move a coefficient up (nor black down): the record and the PNG say none,
    C2PA and IPTC are still there."""
    from neuron_app.engine.records import CacheResult, GenerationRecord
    from neuron_app.engine.trust.marks import Marker

    white = Image.new("RGB", (256, 256), (255, 255, 255))
    assert embed_watermark(white, PAYLOAD) is None
    record = GenerationRecord(
        "256x256", 2, 1, "a marked lighthouse", CacheResult.MISS, False, 0.0, 0.0, 0.0, 0, "tiny", image=white
    )
    data = Marker(make_settings()).encode(record, {"prompt": record.prompt, "model": "tiny"})
    assert record.marks["watermark"] == "none: lumaQim could not hold the payload in these pixels"
    assert Image.open(io.BytesIO(data)).text["watermark"] == record.marks["watermark"]
    assert c2pa_manifest(data)[1] == "Valid" and set(record.marks) == {"c2pa", "iptc", "watermark"}


def test_a_keyed_watermark_checks_only_under_its_key(make_settings: Callable[..., Any], tmp_path: Path) -> None:
    """With watermark_secret, each image carries a fresh id and its HMAC: verify with the key names it; under
    another key, or for the public FLUX2K payload, it is not this server's keyed mark."""
    from neuron_app.engine.records import CacheResult, GenerationRecord
    from neuron_app.engine.trust.marks import Marker, keyed_id
    from neuron_app.verify import verify_file

    key = b"operator-watermark-key-0123456789"
    settings = make_settings(watermark_secret=key.decode())
    image = Image.fromarray(np.random.default_rng(4).integers(0, 256, (256, 256, 3), dtype=np.uint8))
    record = GenerationRecord(
        "256x256", 2, 1, "a marked lighthouse", CacheResult.MISS, False, 0.0, 0.0, 0.0, 0, "tiny", image=image
    )
    path = tmp_path / "keyed.png"
    path.write_bytes(Marker(settings).encode(record, {"prompt": record.prompt, "model": "tiny"}))
    found = read_watermark(Image.open(path))
    assert found is not None and found != PAYLOAD and keyed_id(key, found) is not None
    assert record.marks["watermark"].startswith(f"keyed, image id {found[:3].hex()}")
    report = verify_file(path, PAYLOAD, None, key)
    assert "keyed to this server's watermark_secret" in report.lines[2] and "watermark" in report.claims
    assert keyed_id(b"another key", found) is None
    assert "watermark" not in verify_file(path, PAYLOAD, None, b"another key").claims
    public = tmp_path / "public.png"
    embed_watermark(image, PAYLOAD).save(public)
    assert keyed_id(key, read_watermark(Image.open(public))) is None


def test_generate_256_through_gradio_client_carries_every_mark(
    marked_app: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradio_client import Client

    from tests.support import PATIENT_HTTP

    client = Client(marked_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    path, info = client.predict("a marked lighthouse", "256x256", 2, 3, api_name="/generate")
    data = Path(path).read_bytes()
    assert_marked(data)
    assert set(info["marks"]) == {"c2pa", "iptc", "watermark"} and info["marks"]["watermark"].startswith("FLUX2K")
    assert "untrusted by default" in info["marks"]["c2pa"] and info["safety"] == "off"

    small_path, small = client.predict("a marked lighthouse", "64x64", 2, 3, api_name="/generate")
    assert small["marks"]["watermark"].startswith("none: 64x64 is under 256x256")
    small_image = Image.open(small_path)
    assert small_image.text["watermark"] == small["marks"]["watermark"]  # the PNG says so too
    assert c2pa_manifest(Path(small_path).read_bytes())[1] == "Valid"

    plain, garbage = tmp_path / "plain.png", tmp_path / "garbage.png"
    Image.open(path).convert("RGB").save(plain)  # the same pixels without metadata: only the watermark is left
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(tmp_path / "n.png")
    garbage.write_bytes(b"\x89PNG not really")
    cache_dir = marked_app.settings.cache_dir
    assert verify(capsys, cache_dir, path, small_path) == 0
    out = capsys.readouterr().out
    assert "C2PA: signed by neuron-app image signer" in out and "validation Trusted" in out  # against its chain
    assert "digital source type trainedAlgorithmicMedia" in out and "model tiny" in out
    assert f"IPTC: Iptc4xmpExt:DigitalSourceType = {DIGITAL_SOURCE_TYPE}" in out
    assert "watermark: FLUX2K (lumaQim): this server's payload" in out
    assert "this server's certificate), marked as AI-generated (c2pa, iptc, watermark)" in out
    assert verify(capsys, cache_dir, plain) == 3  # the watermark alone is a claim, not proof
    out = capsys.readouterr().out
    assert "C2PA: none" in out and "verdict: carries an AI-generated claim (not proof of origin): watermark" in out
    assert verify(capsys, cache_dir, tmp_path / "n.png") == 1
    assert "verdict: no neuron-app marks" in capsys.readouterr().out
    tampered = tmp_path / "tampered.png"
    tampered.write_bytes(retext(Path(path).read_bytes(), b"a marked lighthouse", b"a marked lighthousE"))
    assert verify(capsys, cache_dir, tampered) == 3  # still claims AI (its marks), and the change is named
    out = capsys.readouterr().out
    assert "validation Invalid" in out and "assertion.dataHash.mismatch" in out
    assert "(not proof of origin): c2pa, iptc, watermark; its C2PA manifest does not match the file" in out
    bad = run_verify(cache_dir, garbage, tmp_path / "missing.png", path)  # the command: exit status, no traceback
    assert bad.returncode == 2 and bad.stdout.count("verdict: unreadable") == 2, bad.stdout + bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr and "verdict: made by neuron-app" in bad.stdout


def test_openai_b64_json_and_url_carry_every_mark(marked_app: Any) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=marked_app.url + "v1", api_key="unused", max_retries=0, timeout=300)
    extra = {"seed": 5, "num_inference_steps": 2}
    result = client.images.generate(prompt="a marked lighthouse", size="256x256", extra_body=extra)
    assert_marked(base64.b64decode(result.data[0].b64_json))
    provenance = result.data[0].model_extra["provenance"]
    assert set(provenance["marks"]) == {"c2pa", "iptc", "watermark"} and provenance["safety"] == "off"
    by_url = client.images.generate(
        prompt="a marked lighthouse", size="256x256", response_format="url", extra_body=extra
    )
    assert_marked(httpx.get(by_url.data[0].url, timeout=30).content)


def test_operator_certificate_signs_and_a_wrong_key_stops_the_start(
    make_settings: Callable[..., Any], tmp_path: Path
) -> None:
    """An operator's chain (made here with cryptography, encrypted key, passphrase from the environment) signs
    the manifest; a key that is not the certificate's, or one half of the pair, is a settings error."""
    from cryptography.hazmat.primitives import serialization

    from neuron_app.engine.records import CacheResult, GenerationRecord
    from neuron_app.engine.trust import c2pa_signing
    from neuron_app.engine.trust.marks import Marker
    from neuron_app.errors import SettingsError

    chain, key = c2pa_signing._make_local_chain()
    private = serialization.load_pem_private_key(key, password=None)
    encrypted = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"operator-passphrase"),
    )
    (tmp_path / "chain.pem").write_bytes(chain)
    (tmp_path / "key.pem").write_bytes(encrypted)
    settings = make_settings(
        c2pa_cert=tmp_path / "chain.pem", c2pa_key=tmp_path / "key.pem", c2pa_key_passphrase="operator-passphrase"
    )
    record = GenerationRecord(
        "256x256", 2, 1, "a marked lighthouse", CacheResult.MISS, False, 0.0, 0.0, 0.0, 0, "tiny",
        image=Image.fromarray(np.random.default_rng(2).integers(0, 256, (256, 256, 3), dtype=np.uint8)),
    )  # fmt: skip
    marker = Marker(settings)
    assert_marked(marker.encode(record, {"prompt": record.prompt, "model": "tiny"}))
    assert record.marks["c2pa"].startswith("signed, operator certificate CN=neuron-app image signer")
    assert not (settings.cache_dir / "c2pa").exists()  # no local chain was made

    _, other_key = c2pa_signing._make_local_chain()
    (tmp_path / "other.pem").write_bytes(other_key)
    with pytest.raises(SettingsError, match="is not the key of the first certificate"):
        Marker(make_settings(c2pa_cert=tmp_path / "chain.pem", c2pa_key=tmp_path / "other.pem"))
    with pytest.raises(SettingsError, match="c2pa_cert and c2pa_key go together"):
        make_settings(c2pa_cert=tmp_path / "chain.pem")
    with pytest.raises(SettingsError, match="watermark_payload"):
        make_settings(watermark_payload="TOOLONG")


def test_mcp_generate_carries_every_mark(marked_app: Any) -> None:
    """The MCP tool's image content is the marked PNG itself, and its record lists the marks."""
    import asyncio
    import json

    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async def call() -> Any:
        async with (
            streamablehttp_client(marked_app.url + "gradio_api/mcp/") as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            args = {"prompt": "a marked lighthouse", "resolution": "256x256", "steps": 2, "seed": 3}
            return await session.call_tool("generate", args)

    result = asyncio.run(call())
    assert not result.isError, result.content
    assert_marked(mcp_image(result))
    (record,) = [json.loads(c.text) for c in result.content if c.type == "text"]
    assert set(record["marks"]) == {"c2pa", "iptc", "watermark"}


def test_verify_names_the_watermarks_minimum_side(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A 320x240 image is under dwtDct's 256 px side: "not readable" says why, not only the size."""
    small = tmp_path / "small.png"
    Image.new("RGB", (320, 240), (90, 120, 30)).save(small)
    assert verify(capsys, tmp_path / "cache", small) == 1
    assert "watermark: not readable (320x240: under the watermark's 256 px minimum side" in capsys.readouterr().out
