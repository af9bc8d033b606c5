"""`python -m neuron_app verify FILE...`: which AI-content marks an image carries, one line per mark.

For each file: the C2PA manifest (signer, validation state, created time, model, digital source type), the
IPTC digital source type in its XMP, and the invisible watermark decoded from the pixels, then a verdict.
Exit 0 when every file carries this server's marks (its C2PA manifest valid for the file as it is, its IPTC
field, or its watermark payload), 1 when one carries none, 2 when one cannot be read as an image. One line per
problem, never a traceback. A manifest that no longer matches its file (changed after signing) is named so.
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
    SOFTWARE,
    WATERMARK_MIN_SIDE,
    read_source_type,
    read_watermark,
    watermark_fits,
)

EXIT_MARKED, EXIT_UNMARKED, EXIT_UNREADABLE = 0, 1, 2
#: c2pa's validation states of a manifest that matches the file ("Trusted": its signer chains to a trust anchor).
VALID_STATES = ("Valid", "Trusted")


@dataclass
class Report:
    path: str
    lines: list[str] = field(default_factory=list)
    ours: list[str] = field(default_factory=list)  # this server's marks found: c2pa, iptc, watermark
    notes: list[str] = field(default_factory=list)  # what the verdict must add (a manifest that no longer matches)
    readable: bool = True

    @property
    def verdict(self) -> str:
        if not self.readable:
            return "unreadable"
        notes = "".join(f"; {note}" for note in self.notes)
        if self.ours:
            return f"made by {SOFTWARE}, marked as AI-generated ({', '.join(self.ours)}){notes}"
        return f"no {SOFTWARE} marks{notes}"


def _short(source_type: str | None) -> str:
    return (source_type or "none").rsplit("/", 1)[-1]


def c2pa_line(data: bytes) -> tuple[str, bool]:
    """The active manifest in one line, and whether it is this software's `c2pa.created` AI claim."""
    import c2pa

    try:
        with c2pa.Reader("image/png", io.BytesIO(data)) as reader:
            manifest = reader.get_active_manifest() or {}
            state = reader.get_validation_state() or "unknown"
            results = reader.get_validation_results() or {}
    except c2pa.C2paError as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return ("none" if "ManifestNotFound" in type(exc).__name__ or "not found" in text.lower() else text), False
    failures = [f["code"] for f in (results.get("activeManifest") or {}).get("failure", [])]
    signature = manifest.get("signature_info") or {}
    signer = ", ".join(str(signature[k]) for k in ("common_name", "issuer") if signature.get(k)) or "unknown signer"
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
        f"signed by {signer}; validation {state_text}; created {created.get('when') or signature.get('time') or '-'}"
        f"; model {model}; software {agent_name or '-'}; digital source type {_short(created.get('digitalSourceType'))}"
    )
    claimed = agent_name == SOFTWARE and created.get("digitalSourceType") == DIGITAL_SOURCE_TYPE
    return line, claimed and state in VALID_STATES


def verify_file(path: Path, payload: bytes) -> Report:
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
    except (OSError, ValueError) as exc:
        report.readable = False
        report.lines.append(f"cannot read it as an image: {type(exc).__name__}: {str(exc)[:200]}")
        return report
    if image.format == "PNG" or data[:4] == b"\x89PNG":
        line, ours = c2pa_line(data)
    else:
        line, ours = f"not checked ({image.format} file; this server writes PNG)", False
    report.lines.append(f"C2PA: {line}")
    if ours:
        report.ours.append("c2pa")
    elif "validation Invalid" in line:
        report.notes.append("its C2PA manifest does not match the file: changed after signing")
    source = read_source_type(image)
    creator = str(image.info.get("xmp", b"") or "") + str(image.info.get("XML:com.adobe.xmp", ""))
    report.lines.append(f"IPTC: Iptc4xmpExt:DigitalSourceType = {source or 'none'}")
    if source == DIGITAL_SOURCE_TYPE and f'CreatorTool="{SOFTWARE}' in creator:
        report.ours.append("iptc")
    found = read_watermark(image) if watermark_fits(*image.size) else None
    if found is None:
        note = image.info.get("watermark")
        size = f"{image.size[0]}x{image.size[1]}"
        if not watermark_fits(*image.size):  # say why: dwtDct needs 256 px on both sides
            size += f": under the watermark's {WATERMARK_MIN_SIDE} px minimum side, so none was written"
        report.lines.append(f"watermark: not readable ({size})" + (f"; PNG says: {note}" if note else ""))
    elif found == payload:
        report.lines.append(f"watermark: {found.decode('ascii')} (dwtDct): this server's payload")
        report.ours.append("watermark")
    else:
        report.lines.append(f"watermark: none (the pixels do not decode to this server's {payload.decode('ascii')!r})")
    return report


def run_verify(files: list[str], *, as_json: bool = False, payload: str | None = None) -> int:
    if payload is None:
        from neuron_app.settings import get_settings

        payload = get_settings().watermark_payload
    reports = [verify_file(Path(name), payload.encode("ascii")) for name in files]
    if as_json:
        rows = [{"file": r.path, "lines": r.lines, "ours": r.ours, "verdict": r.verdict} for r in reports]
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
    return EXIT_MARKED if all(r.ours for r in reports) else EXIT_UNMARKED


def main_args(args: Any) -> int:
    return run_verify(args.files, as_json=args.json)
