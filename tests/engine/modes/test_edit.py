"""Editing with reference images on the tiny model: buckets, one compile per (output, reference tokens), the
`edit` API through gradio_client, and every bad upload refused before any model work."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from gradio_client import handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from neuron_app.engine.manager import PipelineManager
from neuron_app.engine.modes.references import load_reference
from neuron_app.errors import RequestError
from neuron_app.web.page.edit_controls import edit_choices
from tests.support import PATIENT_HTTP, TINY_OVERRIDES


def png(width: int, height: int, color: tuple[int, int, int] = (200, 40, 40), mode: str = "RGB") -> bytes:
    """A real PNG with a gradient, so that resizing and cropping show in the pixels."""
    image = Image.new(mode, (width, height), color if mode == "RGB" else None)
    if mode == "RGB":
        image.paste((color[2], color[0], color[1]), (0, 0, width // 2, height))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims `width` x `height` and holds almost nothing: what a decompression bomb looks like."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_one_and_two_references_through_the_manager(module_manager: PipelineManager, tmp_path: Path) -> None:
    """Both graphs are this test's own (80 and 112 tokens: no other test here edits at those totals), so each first
    request compiles whichever test ran before it."""
    before = module_manager.status().compiles
    record = module_manager.generate("make it blue", "64x64", 2, 3, references=[png(200, 200)])
    assert record.image.size == (64, 64)
    assert record.compiled and record.graphs_compiled == 1 and record.cache == "miss"
    assert [{k: r[k] for k in ("size", "bucket")} for r in record.info()["references"]] == [
        {"size": "200x200", "bucket": "128x128"}
    ]
    assert record.info()["references"][0]["sha256"] == hashlib.sha256(png(200, 200)).hexdigest()

    path = tmp_path / "square.png"
    path.write_bytes(png(100, 100, (10, 200, 10)))
    two = module_manager.generate("mix them", "64x64", 2, 3, references=[path, Image.new("RGB", (70, 140))])
    assert [(r["size"], r["bucket"]) for r in two.references] == [("100x100", "128x128"), ("70x140", "64x128")]
    assert two.graphs_compiled == 1
    status = module_manager.status()
    assert status.compiles == before + 2
    assert status.edits["64x64 + 1 ref (128x128)"].state == "ready"
    assert status.edits["64x64 + 2 refs (128x128, 64x128)"].hits == 1
    assert status.shapes["64x64"].state == "not_compiled"  # an edit graph is not the text-to-image graph


def test_references_snapping_to_buckets_of_one_token_total_compile_once(module_manager: PipelineManager) -> None:
    """300x140 snaps to 128x64 and 140x300 to 64x128: 32 tokens each, one graph; repeats compile nothing."""
    before = module_manager.status().compiles
    first = module_manager.generate("edit", "64x128", 1, 0, references=[png(300, 140)])
    second = module_manager.generate("edit", "64x128", 1, 0, references=[png(140, 300)])
    again = module_manager.generate("edit", "64x128", 1, 5, references=[png(310, 150)])
    assert (first.graphs_compiled, second.graphs_compiled, again.graphs_compiled) == (1, 0, 0)
    assert (second.cache, again.cache) == ("memory", "memory")
    status = module_manager.status()
    assert status.compiles == before + 1
    shared = status.edits["64x128 + 1 ref (64x128)"]
    assert shared.state == "ready" and shared.shared_with == "64x128 + 1 ref (128x64)"


def test_n_edits_decode_their_references_once(
    module_manager: PipelineManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several images of one edit are validated once: the upload is read, decoded and fitted once for all of them
    (was 1 + n times), and every image reports the same reference."""
    from neuron_app.engine.modes import references
    from neuron_app.web.multi_image import generate_many

    path = tmp_path / "ref.png"
    path.write_bytes(png(200, 100))
    loads: list[Any] = []
    real = references.load_reference
    monkeypatch.setattr(references, "load_reference", lambda *a, **k: loads.append(a[1]) or real(*a, **k))
    records = generate_many(module_manager, "edit", "64x64", 1, 7, 3, references=[str(path)])
    assert [r.seed for r in records] == [7, 8, 9] and len(loads) == 1
    assert {r.references[0]["sha256"] for r in records} == {hashlib.sha256(path.read_bytes()).hexdigest()}


def test_auto_follows_the_first_references_orientation(module_manager: PipelineManager) -> None:
    wide = module_manager.generate("auto", "auto", 1, 0, references=[png(240, 120), png(90, 200)])
    tall = module_manager.generate("auto", "auto", 1, 0, references=[png(120, 240), png(200, 90)])
    assert (wide.resolution, tall.resolution) == ("128x64", "64x128")
    assert wide.image.size == (128, 64) and tall.image.size == (64, 128)
    assert tall.graphs_compiled == 0  # same token total as the wide one: the transposed edit is free


def test_same_references_seed_and_prompt_give_the_same_image(module_manager: PipelineManager) -> None:
    args = ("make it blue", "64x64", 2, 11)
    one = module_manager.generate(*args, references=[png(200, 100)])
    two = module_manager.generate(*args, references=[png(200, 100)])
    other = module_manager.generate(*args, references=[png(200, 100, (0, 0, 255))])
    assert one.image.tobytes() == two.image.tobytes()
    assert other.image.tobytes() != one.image.tobytes()  # the reference really reaches the model


_TRUNCATED = png(100, 100)[:60]


@pytest.mark.parametrize(
    ("references", "resolution", "fragment"),
    [
        pytest.param([b"plain text, not an image"], "64x64", "is not a readable image", id="not-an-image"),
        pytest.param([_TRUNCATED], "64x64", "is not a readable image", id="truncated"),
        pytest.param([png(32, 100)], "64x64", "each side must be at least 64 px", id="under-64px"),
        pytest.param([png(640, 64)], "64x64", "aspect ratio must be at most 8:1", id="aspect-over-8"),
        pytest.param([png(64, 64)] * 5, "64x64", "5 reference images given; the limit is 4", id="too-many"),
        pytest.param([], "64x64", "needs at least one reference image", id="none"),
        pytest.param([png_header(20000, 20000)], "64x64", "has too many pixels", id="bomb-pillow-limit"),
        pytest.param([png_header(8000, 8000)], "64x64", "this one is 8000x8000", id="bomb-own-limit"),
        pytest.param([b"\0" * (21 * 1024 * 1024)], "64x64", "is 21.0 MB; the limit is 20 MB", id="over-upload"),
        pytest.param(["/nonexistent/ref.png"], "64x64", "could not be read", id="missing-file"),
        pytest.param([42], "64x64", "must be an image file, bytes or a PIL image", id="wrong-type"),
        pytest.param([png(64, 64), b"junk"], "64x64", "reference image 2 is not a readable image", id="second-bad"),
        pytest.param(None, "auto", "'auto' needs reference images", id="auto-without-references"),
        pytest.param([png(64, 64)], "1024x1024", "not offered", id="resolution-not-offered"),
    ],
)
def test_bad_references_are_refused_before_any_model_work(
    module_manager: PipelineManager, references: Any, resolution: str, fragment: str
) -> None:
    before = module_manager.status().compiles
    with pytest.raises(RequestError, match=fragment):
        module_manager.generate("edit", resolution, 2, 0, references=references)
    assert module_manager.status().compiles == before


def test_editing_disabled_refuses_without_loading(make_settings: Any) -> None:
    manager = PipelineManager(make_settings(max_references=0))
    with pytest.raises(RequestError, match=r"image editing is disabled on this server \(max_references = 0\)"):
        manager.generate("edit", "64x64", 2, 0, references=[png(64, 64)])
    assert not manager.loaded and manager.status().compiles == 0


def _save(image: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def test_uploads_of_every_kind_become_rgb_at_their_bucket(make_settings: Any) -> None:
    """Alpha on white, palette with transparency, CMYK, 16-bit grayscale, animation (first frame), EXIF rotation."""
    settings = make_settings()
    clear = load_reference(settings, _save(Image.new("RGBA", (100, 100), (255, 0, 0, 0)), "PNG"))
    assert clear.image.mode == "RGB" and clear.image.size == (128, 128)
    assert clear.image.getpixel((5, 5)) == (255, 255, 255)  # transparent -> white

    palette = Image.new("P", (128, 64), 1)
    palette.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)
    ref = load_reference(settings, _save(palette, "PNG", transparency=0))
    assert ref.image.getpixel((3, 3)) == (0, 0, 255) and ref.bucket.width == 128

    cmyk = load_reference(settings, _save(Image.new("CMYK", (64, 64), (0, 255, 255, 0)), "JPEG"))
    red, green, blue = cmyk.image.getpixel((10, 10))
    assert red > 200 and green < 60 and blue < 60

    deep = Image.new("I;16", (64, 64))
    deep.paste(65535, (0, 0, 32, 64))
    gray = load_reference(settings, _save(deep, "PNG"))
    assert gray.image.getpixel((5, 5)) == (255, 255, 255) and gray.image.getpixel((60, 5)) == (0, 0, 0)

    frames = [Image.new("RGB", (64, 64), c) for c in ((0, 255, 0), (255, 0, 0))]
    anim = load_reference(settings, _save(frames[0], "GIF", save_all=True, append_images=frames[1:]))
    assert anim.image.getpixel((30, 30))[1] > 200  # the first frame

    photo = Image.new("RGB", (64, 128), (0, 0, 0))
    exif = photo.getexif()
    exif[0x0112] = 6  # stored portrait, shown rotated 90 degrees: landscape
    turned = load_reference(settings, _save(photo, "JPEG", exif=exif))
    assert (turned.size, str(turned.bucket)) == ("128x64", "128x64")


def test_edit_through_gradio_client(client: Any, launched_app: Any, tmp_path: Path) -> None:
    first = tmp_path / "wide.png"
    first.write_bytes(png(200, 100))
    path, info = client.predict("make it blue", [handle_file(str(first))], "64x64", 2, 5, api_name="/edit")
    assert info["resolution"] == "64x64" and info["references"][0]["bucket"] == "128x64"
    assert info["references"][0]["size"] == "200x100" and {"cache", "compiled", "inference_s"} <= info.keys()
    with Image.open(path) as image:
        assert image.size == (64, 64)
        recorded = json.loads(image.text["references"])
    assert recorded == [{"bucket": "128x64", "sha256": hashlib.sha256(first.read_bytes()).hexdigest()}]

    second = tmp_path / "tall.png"
    second.write_bytes(png(100, 200))
    refs = [handle_file(str(second)), handle_file(str(first))]
    path, info = client.predict("combine", refs, "auto", 2, 5, api_name="/edit")
    assert info["resolution"] == "64x128" and [r["bucket"] for r in info["references"]] == ["64x128", "128x64"]

    status = client.predict(api_name="/status")
    assert status["edits"]["64x64 + 1 ref (128x64)"]["state"] == "ready"
    # The page's dropdown labels for one 128x64 reference: auto first, 64x64 ready, the rest not yet.
    labels = dict((v, k) for k, v in edit_choices(launched_app.manager.status(), ["128x64"]))
    assert labels["64x64"] == "64x64 + 1 ref - ready" and "not compiled" in labels["128x128"]
    assert next(iter(labels)) == "auto"


def test_edit_bad_upload_through_gradio_client(client: Any, tmp_path: Path) -> None:
    before = client.predict(api_name="/status")["compiles"]
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    with pytest.raises(AppError, match="reference image 1 is not a readable image"):
        client.predict("edit", [handle_file(str(text))], "64x64", 2, 0, api_name="/edit")
    with pytest.raises(AppError, match="needs at least one reference image"):
        client.predict("edit", [], "64x64", 2, 0, api_name="/edit")
    assert client.predict(api_name="/status")["compiles"] == before


def test_upload_over_the_size_limit_is_refused_by_gradio(launch_tiny: Any, tmp_path: Path) -> None:
    from gradio_client import Client

    app = launch_tiny(max_upload_mb=0.01)
    big = tmp_path / "big.png"
    big.write_bytes(png(64, 64) + b"\0" * 20_000)
    client = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    with pytest.raises(Exception, match=r"(?i)file size|too large|exceeds"):
        client.predict("edit", [handle_file(str(big))], "64x64", 2, 0, api_name="/edit")
    assert client.predict(api_name="/status")["loaded"] is False  # refused at upload: no model work at all


def test_settings_reference_buckets_default_to_served_shapes(make_settings: Any) -> None:
    settings = make_settings()
    assert [str(r) for r in settings.parsed_reference_resolutions] == TINY_OVERRIDES["resolutions"]
    assert [str(r) for r in make_settings(reference_resolutions=["64x64"]).parsed_reference_resolutions] == ["64x64"]
    from neuron_app.errors import SettingsError

    with pytest.raises(SettingsError, match="at most 1048576 pixels"):
        make_settings(reference_resolutions=["2048x2048"])
    tiny_only = PipelineManager(make_settings(resolutions=["32x32"], default_resolution="32x32"))  # still serves
    with pytest.raises(RequestError, match="image editing needs reference buckets"):
        tiny_only.generate("edit", "32x32", 1, 0, references=[png(64, 64)])


def test_precompile_references_then_warm_up_from_the_manifest(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`precompile --references 1` compiles the edit graph and records it; a server with warmup=precompiled
    lists it as precompiled and compiles it at start."""
    from neuron_app.__main__ import main
    from neuron_app.engine.manager import get_manager
    from neuron_app.settings import get_settings

    settings = make_settings()
    for key, value in (TINY_OVERRIDES | {"cache_dir": str(settings.cache_dir)}).items():
        monkeypatch.setenv(f"NEURON_APP_{key.upper()}", value if isinstance(value, str) else json.dumps(value))
    get_settings.cache_clear()
    get_manager.cache_clear()
    try:
        assert main(["precompile", "--resolutions", "64x64", "--references", "1", "--reference-bucket", "128x64"]) == 0
        assert main(["precompile", "--resolutions", "64x64", "--references", "9"]) == 2  # over max_references
    finally:
        get_settings.cache_clear()
        get_manager.cache_clear()
    out = capsys.readouterr()
    assert "64x64 + 1 ref (128x64)  ready" in out.out and "between 0 and max_references (4)" in out.err

    server = PipelineManager(make_settings(warmup="precompiled"))
    label = "64x64 + 1 ref (128x64)"
    assert server.status().edits[label].manifest == "precompiled" and server.warmup_order() == [label]
    server.start_warmup().join(timeout=300)
    assert server.status().edits[label].state == "ready"
    record = server.generate("edit", "64x64", 1, 0, references=[png(200, 100)])
    assert not record.compiled and record.cache == "memory"
