"""AI-content marks on every image (engine/trust/marks.py) and `python -m neuron_app verify`.

Real libraries end to end: a 256x256 image of the launched tiny app from gradio_client's `/generate` and from
the OpenAI SDK (`b64_json` and `url`) carries a C2PA manifest that c2pa.Reader reads and validates, the IPTC
digital source type in its XMP, and the FLUX2K watermark that imwatermark decodes; `verify` says so (exit 0),
finds nothing on a plain PNG (1) and refuses garbage (2), without a traceback.
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

from neuron_app.engine.trust.marks import DIGITAL_SOURCE_TYPE, XMP_KEY, add_watermark, embed_watermark, read_watermark
from tests.support import ROOT

SHAPES = ["64x64", "256x256"]
PAYLOAD = b"FLUX2K"


def decode_watermark(image: Image.Image) -> bytes:
    """The library's own decoder, as a third party would run it on the pixels."""
    from imwatermark import WatermarkDecoder

    bgr = np.ascontiguousarray(np.asarray(image.convert("RGB"))[:, :, ::-1])
    return bytes(WatermarkDecoder("bytes", 48).decode(bgr, "dwtDct"))


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
    assert decode_watermark(image) == PAYLOAD


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


def verify(capsys: pytest.CaptureFixture[str], *files: Any) -> int:
    """`python -m neuron_app verify` in this process (its argument parser and exit status)."""
    from neuron_app.__main__ import main

    capsys.readouterr()
    return main(["verify", *map(str, files)])


def run_verify(*files: Any) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    return subprocess.run(
        [sys.executable, "-m", "neuron_app", "verify", *map(str, files)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


@pytest.fixture(scope="module")
def marked_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(resolutions=SHAPES, default_resolution="64x64")


def test_watermark_survives_on_noise_and_says_when_too_small() -> None:
    """dwtDct holds the 48 bits on 256x256 noise (what the tiny model draws) and on smooth images."""
    rng = np.random.default_rng(42)
    single = 0
    for seed in range(8):
        noise = Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8))
        detail = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)  # photo-like: smooth areas, some texture
        smooth = Image.fromarray(detail).resize((256, 256), Image.Resampling.BICUBIC)
        for image in (noise, smooth):
            single += decode_watermark(add_watermark(image, PAYLOAD)) == PAYLOAD
            marked = embed_watermark(image, PAYLOAD)
            assert marked is not None and decode_watermark(marked) == PAYLOAD, seed
    assert single < 16  # one pass alone loses bits on some of these: why embed_watermark reads back and repeats
    assert read_watermark(Image.new("RGB", (128, 512))) is None  # under 256 on one side: not even tried


def test_a_flat_image_says_it_holds_no_watermark(make_settings: Callable[..., Any]) -> None:
    """dwtDct cannot hold bits in a solid colour (measured): the record and the PNG say none, C2PA and IPTC
    are still there."""
    from neuron_app.engine.records import CacheResult, GenerationRecord
    from neuron_app.engine.trust.marks import Marker

    flat = Image.new("RGB", (256, 256), (90, 140, 200))
    assert embed_watermark(flat, PAYLOAD) is None  # the library's limit, as it is today
    record = GenerationRecord(
        "256x256", 2, 1, "a marked lighthouse", CacheResult.MISS, False, 0.0, 0.0, 0.0, 0, "tiny", image=flat
    )
    data = Marker(make_settings()).encode(record, {"prompt": record.prompt, "model": "tiny"})
    assert record.marks["watermark"] == "none: dwtDct could not hold the payload in these pixels"
    assert Image.open(io.BytesIO(data)).text["watermark"] == record.marks["watermark"]
    assert c2pa_manifest(data)[1] == "Valid" and set(record.marks) == {"c2pa", "iptc", "watermark"}


def test_generate_256_through_gradio_client_carries_every_mark(
    marked_app: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradio_client import Client

    client = Client(marked_app.url, verbose=False)
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
    assert verify(capsys, path, small_path) == 0
    out = capsys.readouterr().out
    assert "C2PA: signed by neuron-app image signer" in out and "validation Valid" in out
    assert "digital source type trainedAlgorithmicMedia" in out and "model tiny" in out
    assert f"IPTC: Iptc4xmpExt:DigitalSourceType = {DIGITAL_SOURCE_TYPE}" in out
    assert "watermark: FLUX2K (dwtDct): this server's payload" in out
    assert "verdict: made by neuron-app, marked as AI-generated (c2pa, iptc, watermark)" in out
    assert verify(capsys, plain) == 0
    out = capsys.readouterr().out
    assert "C2PA: none" in out and "marked as AI-generated (watermark)" in out
    assert verify(capsys, tmp_path / "n.png") == 1
    assert "verdict: no neuron-app marks" in capsys.readouterr().out
    tampered = tmp_path / "tampered.png"
    tampered.write_bytes(retext(Path(path).read_bytes(), b"a marked lighthouse", b"a marked lighthousE"))
    assert verify(capsys, tampered) == 0  # still AI-marked (IPTC, watermark), and the change is named
    out = capsys.readouterr().out
    assert "validation Invalid" in out and "assertion.dataHash.mismatch" in out
    assert "(iptc, watermark); its C2PA manifest does not match the file: changed after signing" in out
    bad = run_verify(garbage, tmp_path / "missing.png", path)  # the command itself: exit status, no traceback
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
    (image,) = [c for c in result.content if c.type == "image"]
    assert_marked(base64.b64decode(image.data))
    (record,) = [json.loads(c.text) for c in result.content if c.type == "text"]
    assert set(record["marks"]) == {"c2pa", "iptc", "watermark"}


def test_verify_names_the_watermarks_minimum_side(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A 320x240 image is under dwtDct's 256 px side: "not readable" says why, not only the size."""
    small = tmp_path / "small.png"
    Image.new("RGB", (320, 240), (90, 120, 30)).save(small)
    assert verify(capsys, small) == 1
    assert "watermark: not readable (320x240: under the watermark's 256 px minimum side" in capsys.readouterr().out
