"""`python -m neuron_app verify FILE...`: which AI-content marks an image carries, one line per mark, and
whether they prove it came from this server or only claim it is AI-made.

For each file: the C2PA manifest (signer, validation state, created time, model, digital source type), the
IPTC digital source type in its XMP, and the invisible watermark decoded from the pixels, then a verdict.
Only a C2PA manifest proves origin: "made by this server" needs one whose hash binds these exact bytes (the
pixels included), validated against this server's certificate chain as the only trust anchor and signed by its
signing certificate (c2pa_cert, or the local chain under cache_dir/c2pa). XMP can be copied onto any image and
the watermark library is public, so a watermark or an IPTC field alone reads "carries an AI-generated claim
(not proof of origin)". Exit 0 when every file is proven this server's, 3 when one only carries claims, 1 when
one carries none, 2 when one cannot be read as an image. One line per problem, never a traceback.
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_app.engine.trust.marks import (
    DIGITAL_SOURCE_TYPE,
    MIME,
    SOFTWARE,
    WATERMARK_METHOD,
    WATERMARK_MIN_SIDE,
    keyed_id,
    read_source_type,
    read_watermark,
    watermark_fits,
)

EXIT_MARKED, EXIT_UNMARKED, EXIT_UNREADABLE, EXIT_CLAIMED = 0, 1, 2, 3
#: c2pa's validation state of a manifest that matches the file and whose signer chains to a trust anchor (here
#: the only anchor is this server's chain).
PROVEN_STATE = "Trusted"


@dataclass
class Report:
    path: str
    lines: list[str] = field(default_factory=list)
    proof: bool = False  # a valid C2PA manifest of this server binds these bytes
    claims: list[str] = field(default_factory=list)  # AI-generated claims found: c2pa, iptc, watermark
    notes: list[str] = field(default_factory=list)  # what the verdict must add (a manifest that no longer matches)
    readable: bool = True

    @property
    def ours(self) -> list[str]:
        """Every mark of this server found, proven or claimed."""
        return ["c2pa", *self.claims] if self.proof else list(self.claims)

    @property
    def verdict(self) -> str:
        if not self.readable:
            return "unreadable"
        notes = "".join(f"; {note}" for note in self.notes)
        if self.proof:
            return (
                f"made by {SOFTWARE} (a valid C2PA manifest binds these bytes, signed by this server's certificate), "
                f"marked as AI-generated ({', '.join(self.ours)}){notes}"
            )
        if self.claims:
            return f"carries an AI-generated claim (not proof of origin): {', '.join(self.claims)}{notes}"
        return f"no {SOFTWARE} marks{notes}"


@dataclass(frozen=True)
class Signer:
    """This server's C2PA chain: its top certificate is the only trust anchor, its first signs."""

    anchor_pem: str
    serial: str
    common_name: str

    @classmethod
    def from_chain(cls, chain_pem: bytes) -> Signer:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.x509.oid import NameOID

        certs = x509.load_pem_x509_certificates(chain_pem)
        names = certs[0].subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        anchor = certs[-1].public_bytes(serialization.Encoding.PEM).decode("ascii")
        return cls(anchor, str(certs[0].serial_number), str(names[0].value) if names else "")


def configured_signer(settings: Any) -> Signer | None:
    """The chain this server signs with (c2pa_cert, else the local one under cache_dir/c2pa), or None when there
    is none yet (verify never makes one)."""
    from neuron_app.engine.trust.c2pa_signing import CHAIN_FILE

    path = settings.c2pa_cert or settings.cache_dir / "c2pa" / CHAIN_FILE
    try:
        return Signer.from_chain(path.read_bytes())
    except (OSError, ValueError):
        return None


def _short(source_type: str | None) -> str:
    return (source_type or "none").rsplit("/", 1)[-1]


def c2pa_line(data: bytes, signer: Signer | None = None, mime: str = "image/png") -> tuple[str, bool, bool]:
    """The active manifest in one line; whether it claims this software's `c2pa.created` AI action; and whether
    that is proof: valid for these bytes, chained to `signer`'s anchor and signed by its certificate."""
    import c2pa

    trust = {"verify": {"verify_trust": True}, "trust": {"trust_anchors": signer.anchor_pem}} if signer else {}
    try:
        with c2pa.Reader(mime, io.BytesIO(data), context=c2pa.Context.from_dict(trust)) as reader:
            manifest = reader.get_active_manifest() or {}
            state = reader.get_validation_state() or "unknown"
            results = reader.get_validation_results() or {}
    except c2pa.C2paError as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (
            ("none" if "ManifestNotFound" in type(exc).__name__ or "not found" in text.lower() else text),
            False,
            False,
        )
    failures = [f["code"] for f in (results.get("activeManifest") or {}).get("failure", [])]
    signature = manifest.get("signature_info") or {}
    names = ", ".join(str(signature[k]) for k in ("common_name", "issuer") if signature.get(k)) or "unknown signer"
    created = None
    for assertion in manifest.get("assertions", []):
        if str(assertion.get("label", "")).startswith("c2pa.actions"):
            created = next((a for a in assertion["data"].get("actions", []) if a.get("action") == "c2pa.created"), None)
    created = created or {}
    agent = created.get("softwareAgent") or {}
    agent_name = agent.get("name") if isinstance(agent, dict) else str(agent)
    model = (created.get("parameters") or {}).get("model", "-")
    state_text = state + (f" ({', '.join(failures)})" if failures else "")
    line = (
        f"signed by {names}; validation {state_text}; created {created.get('when') or signature.get('time') or '-'}"
        f"; model {model}; software {agent_name or '-'}; digital source type {_short(created.get('digitalSourceType'))}"
    )
    claimed = agent_name == SOFTWARE and created.get("digitalSourceType") == DIGITAL_SOURCE_TYPE
    ours = signer is not None and (str(signature.get("cert_serial_number")), signature.get("common_name")) == (
        signer.serial,
        signer.common_name,
    )
    return line, claimed, claimed and state == PROVEN_STATE and ours


def verify_file(path: Path, payload: bytes, signer: Signer | None = None, key: bytes | None = None) -> Report:
    from PIL import Image, UnidentifiedImageError

    report = Report(str(path))
    try:
        data = path.read_bytes()
        image = Image.open(io.BytesIO(data))
        image.load()
    except UnidentifiedImageError:
        report.readable = False
        report.lines.append("cannot read it as an image: not an image format Pillow knows")
        return report
    except (OSError, ValueError, Image.DecompressionBombError) as exc:  # a bomb: unreadable, never a traceback
        report.readable = False
        report.lines.append(f"cannot read it as an image: {type(exc).__name__}: {str(exc)[:200]}")
        return report
    mime = MIME.get(str(image.format).lower())
    if mime is not None:
        line, claimed, report.proof = c2pa_line(data, signer, mime)
    else:
        line, claimed = f"not checked ({image.format} file; this server writes PNG, JPEG and WebP)", False
    report.lines.append(f"C2PA: {line}")
    if claimed and not report.proof:
        report.claims.append("c2pa")
        if "validation Invalid" in line:
            report.notes.append("its C2PA manifest does not match the file: changed after signing")
        else:
            report.notes.append("its C2PA manifest is not signed by this server's certificate")
    source = read_source_type(image)
    report.lines.append(f"IPTC: Iptc4xmpExt:DigitalSourceType = {source or 'none'}")
    if source == DIGITAL_SOURCE_TYPE:
        report.claims.append("iptc")
    found = read_watermark(image) if watermark_fits(*image.size) else None
    if found is None:
        note = image.info.get("watermark")
        size = f"{image.size[0]}x{image.size[1]}"
        if not watermark_fits(*image.size):  # say why: dwtDct needs 256 px on both sides
            size += f": under the watermark's {WATERMARK_MIN_SIDE} px minimum side, so none was written"
        report.lines.append(f"watermark: not readable ({size})" + (f"; PNG says: {note}" if note else ""))
    elif key is not None and keyed_id(key, found) is not None:
        image_id = found[:3].hex()
        report.lines.append(
            f"watermark: keyed to this server's watermark_secret, image id {image_id} ({WATERMARK_METHOD})"
        )
        report.claims.append("watermark")
    elif found == payload:
        report.lines.append(f"watermark: {found.decode('ascii')} ({WATERMARK_METHOD}): this server's payload")
        report.claims.append("watermark")
    else:
        report.lines.append(f"watermark: none (the pixels do not decode to this server's {payload.decode('ascii')!r})")
    return report


def run_verify(files: list[str], *, as_json: bool = False, payload: str | None = None) -> int:
    from neuron_app.settings import get_settings

    settings = get_settings()
    signer = configured_signer(settings)
    data = (payload if payload is not None else settings.watermark_payload).encode("ascii")
    key = settings.watermark_secret.get_secret_value().encode() if settings.watermark_secret is not None else None
    reports = [verify_file(Path(name), data, signer, key) for name in files]
    if as_json:
        rows = [
            {
                "file": r.path,
                "lines": r.lines,
                "proof": r.proof,
                "claims": r.claims,
                "ours": r.ours,
                "verdict": r.verdict,
            }
            for r in reports
        ]
        print(json.dumps(rows, indent=2))
    else:
        for report in reports:
            print(report.path)
            for line in report.lines:
                print(f"  {line}")
            print(f"  verdict: {report.verdict}")
    sys.stdout.flush()
    if any(not r.readable for r in reports):
        return EXIT_UNREADABLE
    if all(r.proof for r in reports):
        return EXIT_MARKED
    return EXIT_CLAIMED if all(r.proof or r.claims for r in reports) else EXIT_UNMARKED


def main_args(args: Any) -> int:
    return run_verify(args.files, as_json=args.json)
