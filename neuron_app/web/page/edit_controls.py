"""The page's editing controls: reference uploads, readiness per reference layout, "use as reference".

Small functions that `ui.py` wires in, so that the page's other features rebase around them. What an edit
costs is read from the manager's status (`edits`), never computed here: the same data a replica reports.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import gradio as gr

from neuron_app.engine.modes.edit_graphs import edit_label
from neuron_app.engine.modes.references import check_references
from neuron_app.engine.records import ManagerStatus, ShapeStatus
from neuron_app.errors import RequestError
from neuron_app.settings import Settings
from neuron_app.shapes import Resolution
from neuron_app.web.page.views import shape_info, shape_label

log = logging.getLogger(__name__)

AUTO = "auto"


def reference_paths(gallery: Sequence[Any] | None) -> list[str] | None:
    """File paths from the Gallery's value ((path, caption) items); None when empty: text-to-image."""
    paths = [item[0] if isinstance(item, (tuple, list)) else item for item in gallery or []]
    return [str(p) for p in paths if p] or None


def reference_buckets(settings: Settings, gallery: Sequence[Any] | None) -> list[str]:
    """The buckets the uploaded references snap to (what decides the edit's graph); [] if none or unreadable."""
    paths = reference_paths(gallery)
    if not paths:
        return []
    try:
        return [str(r.bucket) for r in check_references(settings, paths)]
    except RequestError as exc:
        gr.Warning(str(exc))  # the page says why now; generating would refuse with the same message
        return []


def _edit_label(state: ShapeStatus | None, shape: str, count: int) -> str:
    name = f"{shape} + {count} ref{'' if count == 1 else 's'}"
    return shape_label(state, name) if state is not None else f"{name} - not compiled"


def edit_choices(status: ManagerStatus, buckets: Sequence[str]) -> list[tuple[str, str]]:
    """Dropdown choices while references are uploaded: `auto` first, then each offered shape labelled with the
    readiness of its edit graph for these buckets."""
    refs = tuple(Resolution.parse(b) for b in buckets)
    choices = [(f"{AUTO} - the shape nearest the first reference's aspect ratio", AUTO)]
    for name, shape in status.shapes.items():
        if shape.offered:
            label = edit_label(Resolution.parse(name), refs)
            choices.append((_edit_label(status.edits.get(label), name, len(refs)), name))
    return choices


def edit_info(status: ManagerStatus, buckets: Sequence[str], value: str | None) -> str:
    """The dropdown's info line while references are uploaded: the edit graph's state for the chosen shape, in
    the words of its label (the text-to-image graph's "ready: no compile" said nothing of the edit's)."""
    if value == AUTO or not value or value not in status.shapes:
        return "auto: the offered shape nearest the first reference's aspect ratio; its edit graph as labelled"
    refs = tuple(Resolution.parse(b) for b in buckets)
    name = f"{value} + {len(refs)} ref{'' if len(refs) == 1 else 's'}"
    state = status.edits.get(edit_label(Resolution.parse(value), refs))
    if state is None:
        return f"{name}: its edit graph is not compiled in this process: the first edit compiles it (or loads it)"
    return shape_info(state, name)


def add_reference(references: Sequence[Any] | None, result: Sequence[Any] | str | None, limit: int) -> Any:
    """ "Use as reference": append the result (the first image when there are several) to the references, for
    iterative editing, within the limit."""
    items = reference_paths(references) or []
    image = (reference_paths(result) or [None])[0] if not isinstance(result, str) else result
    if not image:
        raise gr.Error("generate an image first", print_exception=False)
    if len(items) >= limit:
        raise gr.Error(f"{len(items)} reference images already; the limit is {limit}", print_exception=False)
    return [*items, image]


def reference_input(settings: Settings) -> Any:
    """The reference upload under the prompt (hidden when editing is off)."""
    return gr.Gallery(
        label=f"Reference images to edit (up to {settings.max_references}; empty = text to image)",
        type="filepath",
        file_types=["image"],
        interactive=True,
        columns=4,
        height="max-content",  # a fixed height showed a strip of a reference drawn at the column's width
        object_fit="contain",
        visible=settings.max_references > 0,
        elem_id="references",
    )
