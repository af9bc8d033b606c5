"""The page's public API: `generate`, `edit`, `inpaint` and `status` as named Gradio endpoints (and MCP tools).

Plain inputs, validated by the manager rather than by Gradio's components, so scripts get the same clear errors as
the page; every device event shares one concurrency id, `status` has its own unlimited lane.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gradio as gr

from neuron_app.engine.contract import Manager
from neuron_app.engine.output.images import ImageStore
from neuron_app.engine.records import GenerationRecord, ProgressCallback, ProgressEvent
from neuron_app.errors import app_error_of, one_line
from neuron_app.web.access import Access, entry_of
from neuron_app.web.page import tool_docs

if TYPE_CHECKING:
    from neuron_app.web.jobs.usage_book import UsageBook

log = logging.getLogger(__name__)

#: All device work queues under this id, so every event waits for the one device.
DEVICE_QUEUE = "device"
#: run(prompt, resolution, steps, seed, progress, request, **options): one image, the caller's limits applied.
Runner = Callable[..., GenerationRecord]


def whole_number(label: str) -> gr.Number:
    """An API number typed `int` in `view_api()` and the MCP schema, yet passed on as sent: the manager refuses
    4.5 steps with its own message, where Number(precision=0) would round it silently. (Not a subclass: Gradio
    writes a .pyi stub next to the module of every Component subclass.)"""
    number = gr.Number(label=label)
    number.api_info = lambda: {"type": "integer"}  # type: ignore[method-assign]
    return number


def user_error(exc: Exception) -> gr.Error:
    """The app's own errors keep their message (written for people); anything else is logged and summarized."""
    known = app_error_of(exc)
    if known is not None:
        if known.kind != "failed":
            log.info("%s: %s", known.kind, known)  # failures: the manager logged them already
        return gr.Error(str(known), print_exception=False)
    log.exception("unexpected error")
    return gr.Error(one_line(exc, limit=200), print_exception=False)


def progress_bridge(progress: gr.Progress) -> ProgressCallback:
    def on_event(event: ProgressEvent) -> None:
        if event.phase == "denoising":
            progress((event.step, event.total), desc=event.message)
        else:
            progress(None, desc=event.message)

    return on_event


def runner(manager: Manager, access: Access, usage: UsageBook | None = None) -> Runner:
    """One generation for an API caller: the per-address page limit, errors counted and said for people, the
    image booked by its interface (gradio_api or mcp)."""

    def run(
        prompt: Any,
        resolution: Any,
        steps: Any,
        seed: Any,
        progress: gr.Progress,
        request: gr.Request | None,
        **options: Any,
    ) -> GenerationRecord:
        try:
            with access.page_images_for(request, 1):
                record = manager.generate(
                    prompt, resolution, steps, seed, progress=progress_bridge(progress), **options
                )
        except Exception as exc:
            access.observe_error(exc, entry_of(request, "gradio_api"))
            raise user_error(exc) from exc
        if usage is not None:
            usage.book(entry_of(request, "gradio_api"), [record])
        return record

    return run


def add(manager: Manager, store: ImageStore, run: Runner, lanes: int) -> None:
    """The hidden API components and their named endpoints; called inside the page's `gr.Blocks`."""
    settings = manager.settings

    def generate(
        prompt: str,
        resolution: str,
        steps: float,
        seed: float,
        lora: str = "none",
        lora_scale: float = 1.0,
        loras: list[dict[str, Any]] | None = None,
        request: gr.Request | None = None,
        progress: gr.Progress = gr.Progress(),
    ) -> tuple[str, dict[str, Any]]:
        record = run(prompt, resolution, steps, seed, progress, request, lora=lora, lora_scale=lora_scale, loras=loras)
        return str(store.save(record)), record.info()

    def edit(
        prompt: str,
        images: list[str] | None,
        resolution: str,
        steps: float,
        seed: float,
        lora: str = "none",
        lora_scale: float = 1.0,
        loras: list[dict[str, Any]] | None = None,
        request: gr.Request | None = None,
        progress: gr.Progress = gr.Progress(),
    ) -> tuple[str, dict[str, Any]]:
        options = {"lora": lora, "lora_scale": lora_scale, "loras": loras, "references": list(images or [])}
        record = run(prompt, resolution, steps, seed, progress, request, **options)
        return str(store.save(record)), record.info()

    def inpaint(
        prompt: str,
        image: str | None,
        mask: str | None,
        resolution: str,
        steps: float,
        seed: float,
        lora: str = "none",
        lora_scale: float = 1.0,
        strength: float = 1.0,
        loras: list[dict[str, Any]] | None = None,
        request: gr.Request | None = None,
        progress: gr.Progress = gr.Progress(),
    ) -> tuple[str, dict[str, Any]]:
        if image is None:
            raise gr.Error("image is required: the image to inpaint", print_exception=False)
        if mask is None:
            raise gr.Error("mask is required: a PNG the image's size (transparent = redraw)", print_exception=False)
        options = {"lora": lora, "lora_scale": lora_scale, "image": image, "mask": mask, "strength": strength}
        options["loras"] = loras
        record = run(prompt, resolution, steps, seed, progress, request, **options)
        return str(store.save(record)), record.info()

    def status() -> dict[str, Any]:
        return manager.status().to_dict()

    # The docstrings are the MCP tool descriptions (Gradio reads the description, Args, one line each, and Returns).
    generate.__doc__, edit.__doc__ = tool_docs.generate_doc(settings), tool_docs.edit_doc(settings)
    inpaint.__doc__, status.__doc__ = tool_docs.inpaint_doc(settings), tool_docs.STATUS_DOC

    # The public API: plain inputs, validated by the manager (not by Gradio's components),
    # so scripts get the same clear errors as the page.
    with gr.Group(visible=False):
        api_prompt = gr.Textbox(label="prompt")  # view_api()'s labels: the names, not parameter_36
        api_resolution = gr.Textbox(label="resolution")
        api_steps = whole_number("steps")
        api_seed = whole_number("seed")
        api_lora = gr.Textbox(value="none", label="lora")  # optional: 4-argument callers keep working
        api_lora_scale = gr.Number(value=1.0, label="lora_scale")
        api_loras = gr.JSON(value=None, label="loras")  # optional, last: [{"name", "scale"}], several styles
        api_references = gr.File(file_count="multiple", label="images")  # any file: the manager says why
        api_image = gr.Image(type="filepath", format="png", label="image")
        api_info = gr.JSON(label="record")
        api_status_out = gr.JSON(label="status")
        api_btn = gr.Button()
        status_btn = gr.Button()
        edit_btn = gr.Button()
        api_source = gr.File(label="image")  # any file: the manager says why one is not an image
        api_mask = gr.File(label="mask")
        api_strength = gr.Number(value=1.0, label="strength")
        inpaint_btn = gr.Button()
    api_styles = [api_lora, api_lora_scale, api_loras]
    api_btn.click(
        generate,
        inputs=[api_prompt, api_resolution, api_steps, api_seed, *api_styles],
        outputs=[api_image, api_info],
        api_name="generate",
        concurrency_id=DEVICE_QUEUE,
        concurrency_limit=lanes,
    )
    edit_btn.click(
        edit,
        inputs=[api_prompt, api_references, api_resolution, api_steps, api_seed, *api_styles],
        outputs=[api_image, api_info],
        api_name="edit",
        concurrency_id=DEVICE_QUEUE,
        concurrency_limit=lanes,
    )
    api_rest = [api_resolution, api_steps, api_seed, api_lora, api_lora_scale, api_strength]
    inpaint_btn.click(
        inpaint,
        inputs=[api_prompt, api_source, api_mask, *api_rest, api_loras],
        outputs=[api_image, api_info],
        api_name="inpaint",
        concurrency_id=DEVICE_QUEUE,
        concurrency_limit=lanes,
    )
    # Status never waits behind a compile: its own unlimited lane, outside the queue.
    status_btn.click(status, outputs=[api_status_out], api_name="status", queue=False, concurrency_limit=None)
