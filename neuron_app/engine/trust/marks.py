"""AI-content marks on every image this server hands out, made in one place (`Marker.encode`).

Three marks, because each survives something the others do not:

- an invisible watermark in the pixels (engine/trust/watermark.py, "lumaQim", 48 bits = `watermark_payload`):
  in the luminance at a fixed 256x256 working size, so it stays when the metadata is stripped, after a JPEG
  re-encode at quality 90 and after resizing down to 256 px (measured in BENCHMARKS.md); images under
  256x256 say in their metadata that they carry none, and each embedding is read back: an image where it did
  not hold (clipped pixels) says so too. A watermark is a claim, not proof: anyone can write these bits;
- IPTC in XMP (a PNG's iTXt chunk `XML:com.adobe.xmp`, the XMP slot of a JPEG or WebP):
  `Iptc4xmpExt:DigitalSourceType` = trainedAlgorithmicMedia, the field photo tools and platforms read
  to label AI images;
- a signed C2PA manifest (c2pa-python): a `c2pa.created` action with that digital source type, the model and
  the software, its hash bound to the final bytes, so any later change to the file is detected.

The order is fixed by what binds what: watermark the pixels, then write the PNG with its text chunks and the
XMP, then sign: the manifest covers the exact bytes that leave the server. The provenance text chunks
(prompt, seed, steps, ...) are written by `engine/output/images.py` as before.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import io
import re
import secrets
import struct
import threading
import zlib
from collections.abc import Mapping
from typing import Any, ClassVar

from neuron_app import __version__

SOFTWARE = "neuron-app"
DIGITAL_SOURCE_TYPE = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
XMP_KEY = "XML:com.adobe.xmp"
WATERMARK_METHOD = "lumaQim"
WATERMARK_BITS = 48
#: The watermark's working size: images under it on either side carry none.
WATERMARK_MIN_SIDE = 256
#: What an image can be written as (OpenAI's output_format), and the lossy formats' quality when none is asked
#: (OpenAI's output_compression defaults to 100).
MIME = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
LOSSY = {"jpeg": "JPEG", "webp": "WEBP"}
LOSSY_DEFAULT = 100
#: zlib level and strategy of every PNG: level 1 encodes a 1024x1024 image several times faster than Pillow's
#: default 6, and run-length matches only (Z_RLE) after the row filter are faster again and smaller, on smooth
#: pictures (whose filtered rows hold few long matches) and on flat ones (runs) alike. The Paeth filter on every row
#: (libpng's, through imagecodecs) makes files as small as Pillow's per-row choice of filter, in half its time
#: (BENCHMARKS.md, postprocess: PNG).
PNG_COMPRESS_LEVEL = 1
PNG_STRATEGY = zlib.Z_RLE
_XMP_SOURCE = re.compile(r"Iptc4xmpExt:DigitalSourceType\s*=\s*\"([^\"]*)\"|<Iptc4xmpExt:DigitalSourceType>([^<]*)<")


def watermark_fits(width: int, height: int) -> bool:
    return min(width, height) >= WATERMARK_MIN_SIDE


def xmp_packet(created: str, model: str) -> str:
    """The XMP with the IPTC digital source type, the creating software and the time."""
    return (
        '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>\n'
        '<x:xmpmeta xmlns:x="adobe:ns:meta/">\n'
        ' <rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">\n'
        '  <rdf:Description rdf:about=""\n'
        '    xmlns:Iptc4xmpExt="http://iptc.org/std/Iptc4xmpExt/2008-02-29/"\n'
        '    xmlns:xmp="http://ns.adobe.com/xap/1.0/"\n'
        f'    Iptc4xmpExt:DigitalSourceType="{DIGITAL_SOURCE_TYPE}"\n'
        f'    xmp:CreatorTool="{SOFTWARE} {__version__} ({_xml(model)})"\n'
        f'    xmp:CreateDate="{created}"/>\n'
        " </rdf:RDF>\n"
        "</x:xmpmeta>\n"
        '<?xpacket end="w"?>'
    )


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace('"', "&quot;")


def add_watermark(image: Any, payload: bytes) -> Any:
    """`image` (PIL) with `payload` embedded in its luminance; the caller checked the size."""
    from neuron_app.engine.trust import watermark

    return watermark.embed(image, payload)


def embed_watermark(image: Any, payload: bytes) -> Any | None:
    """`image` with `payload` that reads back, or None when it did not hold (pixels clipped at 0 or 255): the
    read-back is the proof that the record's claim is true, and costs a few milliseconds."""
    marked = add_watermark(image, payload)
    return marked if read_watermark(marked) == payload else None


def read_watermark(image: Any) -> bytes | None:
    """The 48 bits in `image`'s pixels as bytes (whatever they are), or None when it is too small to hold any."""
    from neuron_app.engine.trust import watermark

    return watermark.read(image)


def keyed_payload(key: bytes, image_id: bytes) -> bytes:
    """A keyed watermark's 48 bits: the 24-bit image id, then 24 bits of its HMAC-SHA256 under the operator's key
    (so only the key's holder can make a payload that checks; one guess in 16.7 million passes by chance)."""
    return image_id + hmac.new(key, b"neuron-app watermark " + image_id, hashlib.sha256).digest()[:3]


def keyed_id(key: bytes, payload: bytes) -> bytes | None:
    """The image id of a keyed watermark's payload when its HMAC checks under `key`, else None."""
    return payload[:3] if len(payload) == 6 and hmac.compare_digest(keyed_payload(key, payload[:3]), payload) else None


def read_source_type(image: Any) -> str | None:
    """The IPTC digital source type in the XMP of a PNG (its iTXt chunk), a JPEG or a WebP (Pillow's `xmp`), or None."""
    xmp = image.info.get(XMP_KEY) or image.info.get("xmp")
    if isinstance(xmp, bytes):
        xmp = xmp.decode("utf-8", "replace")
    match = _XMP_SOURCE.search(xmp or "")
    return (match.group(1) or match.group(2)).strip() if match else None


def _reads_back(data: bytes, payload: bytes) -> bool:
    """Whether the lossy file still carries the watermark `payload` (a low output_compression can erase it)."""
    from PIL import Image

    return read_watermark(Image.open(io.BytesIO(data))) == payload


def png_bytes(image: Any, texts: Mapping[str, str]) -> bytes:
    """`image` as PNG (libpng through imagecodecs: level 1, Z_RLE, Paeth rows) with `texts` as iTXt chunks after the
    header, as Pillow's `PngInfo.add_itxt` writes them (uncompressed, no language)."""
    import imagecodecs
    import numpy as np

    pixels = np.asarray(image if image.mode in ("RGB", "RGBA", "L", "LA") else image.convert("RGB"))
    options = {"level": PNG_COMPRESS_LEVEL, "strategy": PNG_STRATEGY, "filter": imagecodecs.PNG.FILTER.PAETH}
    data = imagecodecs.png_encode(pixels, **options)
    header_end = 8 + 8 + 13 + 4  # signature, then IHDR: length and type, 13 bytes, CRC
    chunks = b"".join(
        _png_chunk(b"iTXt", key.encode("latin-1") + b"\0\0\0\0\0" + value.encode()) for key, value in texts.items()
    )
    return bytes(data[:header_end]) + chunks + bytes(data[header_end:])


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


class Marker:
    """Marks images for one configuration: the watermark payload and the C2PA signing key (made once)."""

    _shared: ClassVar[dict[tuple, Marker]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, settings: Any) -> None:
        from neuron_app.engine.trust.c2pa_signing import ManifestSigner, signing_key

        self.payload = settings.watermark_payload.encode("ascii")
        secret = getattr(settings, "watermark_secret", None)
        self.watermark_key = secret.get_secret_value().encode() if secret is not None else None
        passphrase = settings.c2pa_key_passphrase.get_secret_value() if settings.c2pa_key_passphrase else None
        key = signing_key(settings.c2pa_cert, settings.c2pa_key, passphrase, settings.cache_dir)
        self.signer = ManifestSigner(key)
        local = key.origin == "local"
        self.signed_by = "local certificate, untrusted by default" if local else f"operator certificate {key.subject}"
        # What makes two markers' files alike (payload, key, signer), as text: one made in a replica serves its caller
        self.identity = hashlib.sha256(b"\0".join([self.payload, self.watermark_key or b"", key.chain_pem])).hexdigest()

    @classmethod
    def for_settings(cls, settings: Any) -> Marker:
        """One marker per signing configuration in this process (the signer check runs once)."""
        secret = getattr(settings, "watermark_secret", None)
        key = secret.get_secret_value() if secret is not None else None
        ident = (settings.watermark_payload, key, settings.c2pa_cert, settings.c2pa_key, settings.cache_dir)
        with cls._shared_lock:
            if ident not in cls._shared:
                cls._shared[ident] = cls(settings)
            return cls._shared[ident]

    def encode(self, record: Any, text: Mapping[str, str], fmt: str = "png", quality: int | None = None) -> bytes:
        """The record's image as a marked, signed `fmt` (png, jpeg, webp; `quality` 0-100 for the lossy two);
        `record.marks` says what it carries."""
        image, marks, payload = self.watermarked(record.image)
        created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        xmp = xmp_packet(created, record.model)
        marks["iptc"] = "trainedAlgorithmicMedia (XMP Iptc4xmpExt:DigitalSourceType)"
        buffer = io.BytesIO()
        if fmt == "png":
            texts = {**{key: str(value) for key, value in text.items()}, "watermark": marks["watermark"], XMP_KEY: xmp}
            buffer.write(png_bytes(image, texts))
        else:  # the XMP packet in the file's own XMP slot (JPEG APP1, WebP's XMP chunk), read by photo tools
            quality = LOSSY_DEFAULT if quality is None else quality
            image.save(buffer, format=LOSSY[fmt], quality=quality, xmp=xmp.encode())
            if payload is not None and not _reads_back(buffer.getvalue(), payload):
                marks["watermark"] = f"none: {WATERMARK_METHOD} did not survive {fmt} at quality {quality}"
        signed = self.signer.sign(buffer.getvalue(), self.manifest(record, created, fmt), MIME[fmt])
        marks["c2pa"] = f"signed, {self.signed_by}"
        record.marks = marks
        return signed

    def watermarked(self, image: Any) -> tuple[Any, dict[str, str], bytes | None]:
        """`image` with the watermark when it fits and holds, the `watermark` mark that says which, its payload."""
        width, height = image.size
        marks: dict[str, str] = {}
        held: bytes | None = None
        if watermark_fits(width, height):
            if self.watermark_key is not None:  # a fresh image id, its HMAC under the operator's key
                image_id = secrets.token_bytes(3)
                payload, said = keyed_payload(self.watermark_key, image_id), f"keyed, image id {image_id.hex()}"
            else:
                payload, said = self.payload, self.payload.decode()
            marked = embed_watermark(image, payload)
            if marked is not None:
                image, held = marked, payload
                marks["watermark"] = f"{said} ({WATERMARK_METHOD}, {WATERMARK_BITS} bits)"
            else:  # pixels clipped at 0 or 255 leave no room: say so rather than claim it
                marks["watermark"] = f"none: {WATERMARK_METHOD} could not hold the payload in these pixels"
        else:
            side = WATERMARK_MIN_SIDE
            marks["watermark"] = f"none: {width}x{height} is under {side}x{side}, too small for {WATERMARK_METHOD}"
        return image, marks, held

    @staticmethod
    def manifest(record: Any, created: str, fmt: str = "png") -> dict[str, Any]:
        """The C2PA manifest: one `c2pa.created` action by this software with the model, AI-generated."""
        agent = {"name": SOFTWARE, "version": __version__}
        parameters = {"model": record.model, "resolution": record.resolution, "steps": record.steps}
        parameters["seed"] = record.seed
        if record.lora != "none":
            parameters["lora"] = record.lora
        action = {
            "action": "c2pa.created",
            "when": created,
            "digitalSourceType": DIGITAL_SOURCE_TYPE,
            "softwareAgent": agent,
            "parameters": parameters,
        }
        return {
            "claim_generator_info": [agent],
            "title": f"{record.resolution}-{record.seed}.{fmt}",
            "format": MIME[fmt],
            "assertions": [{"label": "c2pa.actions", "data": {"actions": [action]}}],
        }
