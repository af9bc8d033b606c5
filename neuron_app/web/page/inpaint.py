"""The page's inpainting controls and the `inpaint` endpoint's description; live previews in the output area.

Small functions that `ui.py` wires in. The brush editor's strokes are the mask (painted = edit); an image
without strokes is image-to-image at the strength slider's value. What runs is engine/modes/img2img.py: the
text-to-image graph of the chosen shape, so a shape ready for text-to-image is ready for this too.
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from neuron_app.engine.modes.previews import PreviewEvent
from neuron_app.engine.records import ProgressCallback, ProgressEvent
from neuron_app.settings import Settings


def editor_source(value: Any, strength: float) -> dict[str, Any]:
    """`validate`'s image options from the ImageEditor's value: {} without an image (text-to-image or an edit);
    the background and the strokes as a mask (white = edit); no strokes: image-to-image at `strength`."""
    if not isinstance(value, dict) or value.get("background") is None:
        return {}
    import numpy as np
    from PIL import Image

    background = value["background"]
    if not hasattr(background, "size"):  # a path (type="filepath" callers)
        background = Image.open(background)
    painted = np.zeros((background.height, background.width), dtype=bool)
    for layer in value.get("layers") or []:
        if layer is None:
            continue
        layer = layer if hasattr(layer, "size") else Image.open(layer)
        if layer.size == background.size:
            painted |= np.asarray(layer.convert("RGBA").getchannel("A")) > 0
    image = background.convert("RGB")
    if not painted.any():
        return {"image": image, "strength": strength}
    return {"image": image, "mask": Image.fromarray(painted.astype(np.uint8) * 255, "L"), "strength": strength}


def source_input(settings: Settings) -> tuple[Any, Any]:
    """The brush editor (upload an image, paint what to redraw) and the strength slider, in a closed accordion."""
    with gr.Accordion("Inpaint or start from an image", open=False, elem_id="inpaint"):
        editor = gr.ImageEditor(
            label="Image: paint what to redraw (no strokes: the whole image, at the strength below)",
            type="pil",
            sources=["upload", "clipboard"],
            brush=gr.Brush(colors=["#ffffff"], color_mode="fixed", default_size=24),
            eraser=gr.Eraser(default_size=24),
            transforms=(),
            layers=False,
            height=320,
            elem_id="inpaint-editor",
        )
        strength = gr.Slider(
            label="Strength (1 = redraw fully; lower keeps more of the image)",
            minimum=0.05,
            maximum=1.0,
            step=0.05,
            value=1.0,
            elem_id="strength",
        )
    return editor, strength


class Previews:
    """The latest step preview, for the output area: set by the worker's progress events, taken by the page's
    thread when it shows progress (web/page/live.py yields on every event)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._latest: Any = None
        self.seen = False  # a preview has been shown: the output area says what it is

    def forward(self, on_event: ProgressCallback) -> ProgressCallback:
        def forwarded(event: ProgressEvent) -> None:
            if isinstance(event, PreviewEvent):
                self._latest = event.preview
                self.seen = self.seen or event.preview is not None
            on_event(event)

        return forwarded

    def gallery(self) -> Any:
        """The gallery's update: the newest preview once, else unchanged."""
        preview, self._latest = self._latest, None
        return gr.update() if preview is None else [preview]
