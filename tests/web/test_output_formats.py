"""OpenAI's `output_format` and `output_compression` through the `openai` SDK: each format carries every mark (C2PA
valid for its bytes, IPTC in its XMP, the watermark) and `python -m neuron_app verify` reads them; bad values are
one-line 400s before any model work."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from neuron_app.engine.trust.marks import DIGITAL_SOURCE_TYPE, MIME, read_source_type, read_watermark
from tests.engine.trust.test_marks import verify

SHAPES = ["64x64", "256x256"]
EXTRA = {"seed": 5, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def formats_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(resolutions=SHAPES, default_resolution="64x64")


def client_of(app: Any) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=app.url + "v1", api_key="unused", max_retries=0, timeout=300)


def assert_marked(data: bytes, fmt: str) -> Image.Image:
    import c2pa

    with c2pa.Reader(MIME[fmt], io.BytesIO(data)) as reader:
        manifest, state = reader.get_active_manifest(), reader.get_validation_state()
    assert state in ("Valid", "Trusted"), state
    actions = next(a for a in manifest["assertions"] if a["label"].startswith("c2pa.actions"))["data"]["actions"]
    assert next(a for a in actions if a["action"] == "c2pa.created")["digitalSourceType"] == DIGITAL_SOURCE_TYPE
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.format == {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt]
    assert read_source_type(image) == DIGITAL_SOURCE_TYPE and read_watermark(image) == b"FLUX2K"
    return image


@pytest.mark.parametrize("fmt", ["jpeg", "webp", "png"])
def test_each_output_format_carries_every_mark_and_verify_reads_them(
    formats_app: Any, fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = client_of(formats_app)
    result = client.images.generate(prompt="a marked lighthouse", size="256x256", output_format=fmt, extra_body=EXTRA)
    data = base64.b64decode(result.data[0].b64_json)
    assert result.output_format == fmt
    assert_marked(data, fmt)
    marks = result.data[0].model_extra["provenance"]["marks"]
    assert set(marks) == {"c2pa", "iptc", "watermark"} and marks["watermark"].startswith("FLUX2K")
    by_url = client.images.generate(
        prompt="a marked lighthouse", size="256x256", output_format=fmt, response_format="url", extra_body=EXTRA
    )
    reply = httpx.get(by_url.data[0].url, timeout=30)
    assert reply.headers["content-type"] == MIME[fmt] and by_url.data[0].url.endswith("." + fmt)
    assert_marked(reply.content, fmt)
    path = tmp_path / f"image.{fmt}"
    path.write_bytes(data)
    assert verify(capsys, formats_app.settings.cache_dir, path) == 0
    out = capsys.readouterr().out
    assert "validation Trusted" in out and "watermark: FLUX2K (lumaQim): this server's payload" in out
    assert "marked as AI-generated (c2pa, iptc, watermark)" in out


def test_output_compression_sets_the_quality_and_bad_values_are_refused(formats_app: Any) -> None:
    from openai import BadRequestError

    client = client_of(formats_app)
    sizes = {}
    for level in (100, 50):
        result = client.images.generate(
            prompt="a marked lighthouse", size="256x256", output_format="jpeg", output_compression=level,
            extra_body=EXTRA,
        )  # fmt: skip
        sizes[level] = len(base64.b64decode(result.data[0].b64_json))
    assert sizes[50] < sizes[100]
    in_flight = formats_app.manager.status().stages["post"]["done"]
    for fields, param in (
        ({"output_format": "gif"}, "output_format"),
        ({"output_format": "jpeg", "output_compression": 101}, "output_compression"),
        ({"output_format": "png", "output_compression": 50}, "output_compression"),
    ):
        with pytest.raises(BadRequestError) as caught:
            client.images.generate(prompt="a lake", size="64x64", **fields)
        assert caught.value.body["param"] == param and "\n" not in caught.value.body["message"]
    assert formats_app.manager.status().stages["post"]["done"] == in_flight  # refused before any model work


def test_an_edit_answers_in_the_asked_format_with_every_mark(formats_app: Any) -> None:
    reference = io.BytesIO()
    Image.new("RGB", (256, 256), (40, 120, 200)).save(reference, format="PNG")
    result = client_of(formats_app).images.edit(
        image=("ref.png", reference.getvalue(), "image/png"), prompt="a marked lighthouse", size="256x256",
        output_format="webp", output_compression=90, extra_body=EXTRA,
    )  # fmt: skip
    assert result.output_format == "webp"
    assert_marked(base64.b64decode(result.data[0].b64_json), "webp")
