"""The Gradio page and its public API (`generate`, `edit`, `status`).

`build_ui` takes a manager (the contract in engine/contract.py: in-process or replicas) and never loads a
model itself: everything it shows is data that the manager produced.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import gradio as gr
from gradio.context import LocalContext

from neuron_app.engine.contract import Manager
from neuron_app.engine.output.images import ImageStore
from neuron_app.engine.output.postprocess import request_slots
from neuron_app.engine.records import (
    GenerationRecord,
    ManagerStatus,
    ProgressCallback,
    ProgressEvent,
)
from neuron_app.engine.requests import MAX_SEED, check_images
from neuron_app.errors import Cancelled
from neuron_app.web.access import Access, entry_of
from neuron_app.web.multi_image import generate_many
from neuron_app.web.page import api_endpoints, edit_controls, history, lora_controls
from neuron_app.web.page import inpaint as painting
from neuron_app.web.page import notes as page_notes
from neuron_app.web.page.api_endpoints import DEVICE_QUEUE
from neuron_app.web.page.live import Runs, live
from neuron_app.web.page.views import (
    SHAPE_COLUMNS,
    dropdown_choices,
    info_markdown,
    shape_info,
    shapes_table,
    status_markdown,
    stopped_markdown,
    waiting_markdown,
)
from neuron_app.web.queue_place import QueuePlace

if TYPE_CHECKING:
    from neuron_app.web.jobs.usage_book import UsageBook

log = logging.getLogger(__name__)

STATUS_REFRESH_S = 2.0
#: Gradio's temporary files older than this are deleted, checked as often (seconds).
TEMP_FILE_MAX_AGE_S = 3600


def build_ui(
    manager: Manager, images: ImageStore, access: Access | None = None, usage: UsageBook | None = None
) -> gr.Blocks:
    """The page; `usage` books what its Generate, gradio_client and MCP make (`python -m neuron_app usage`)."""
    settings = manager.settings
    access = access or Access(settings)  # the per-address page limit and the content-refusal counts
    lanes = request_slots(settings)  # one device event per replica, plus the post slots (engine/output/postprocess.py)
    run = api_endpoints.runner(manager, access, usage)

    def ui_generate(
        prompt: str,
        resolution: str,
        steps: float,
        seed: float,
        count: float,
        randomize: bool,
        lora: str,
        lora_scale: float,
        references: Any = None,
        buckets: list[str] | None = None,
        source: Any = None,
        strength: float = 1.0,
        request: gr.Request | None = None,
        progress: gr.Progress = gr.Progress(),
        more_styles: list[Any] | None = None,
    ) -> Iterator[tuple[Any, ...]]:
        """The page's Generate: the output area says what runs and for how long (web/page/live.py), then the images."""
        if randomize:  # room for the consecutive seeds of the most images a request may ask for
            seed = random.randint(0, MAX_SEED - (settings.max_images - 1))
        refs = edit_controls.reference_paths(references)
        options = {**lora_controls.page_styles(lora, lora_scale, more_styles), "references": refs}
        options["previews"] = settings.previews
        options |= painting.editor_source(source, strength)  # an image in the brush editor: inpaint or img2img
        previews = painting.Previews(settings.previews)  # each step's preview in the gallery while it runs

        session = request.session_hash if request is not None else None
        run = runs.start(session, int(count) if isinstance(count, int | float) else 1, LocalContext.event_id.get(None))
        if run is None:  # Stop was pressed while it waited in Gradio's queue
            yield gr.update(), "**Stopped** before it started: no image was made.", gr.update(), gr.update(), []
            return
        # Its place behind the requests on the device or waiting for it, as the API counts it (web/queue_place.py).
        now = manager.status()
        lane = (now.stages or {}).get("device") or {}
        place = QueuePlace.taken(now, int(lane.get("waiting", 0)) + int(lane.get("running", 0)), settings.device_lanes)
        place = dataclasses.replace(place, images=run.images, resolution=str(resolution))

        def waiting(elapsed_s: float) -> str | None:
            status = manager.status()
            return waiting_markdown(place.figures(status), status, elapsed_s)

        def seen_by(forward: ProgressCallback) -> ProgressCallback:
            def on_event(event: ProgressEvent) -> None:
                run.event = event  # where Stop would stop it
                forward(event)

            return on_event

        def made(record: GenerationRecord) -> None:  # each image as it is made: a Stop later keeps it
            run.kept.append((record, str(images.save(record)), info_markdown(record)))

        def work(on_event: ProgressCallback) -> list[GenerationRecord]:
            on_event = previews.forward(seen_by(on_event))
            with access.page_images_for(request, check_images(count, settings.max_images)):  # per address
                return generate_many(
                    manager, prompt, resolution, steps, seed, count, progress=on_event, on_record=made, **options
                )

        def line(text: str) -> tuple[Any, ...]:
            shown = previews.gallery()
            if previews.seen and run.event is not None and run.event.phase == "denoising":
                text += page_notes.PREVIEW_NOTE  # a preview in the gallery: what it is
            return shown, text, gr.update(), gr.update(), gr.update()

        note: list[str] = []
        try:
            yield from live(
                work, manager.status, api_endpoints.progress_bridge(progress), line, waiting=waiting, run=run
            )
        except Cancelled:  # the page's Stop: the images made before it are kept
            if len(run.kept) < run.images:
                note.append(stopped_markdown(run.event, len(run.kept), run.images))
        except Exception as exc:
            runs.end(session, run)
            access.observe_error(exc, entry_of(request, "page"))
            error = api_endpoints.user_error(exc)
            yield line(f"**Not generated:** {error.message}")  # the reason stays in the output area, not the seed
            raise error from exc
        runs.end(session, run)
        kept = list(run.kept)
        if usage is not None:  # a Stop's images too: they were made
            usage.book(entry_of(request, "page"), [record for record, _path, _line in kept])
        status = manager.status()
        choices = choices_for(status, buckets)
        value = resolution if resolution == edit_controls.AUTO or not kept else kept[0][0].resolution
        yield (
            [path for _record, path, _line in kept],  # a Stop's preview or an older image: not shown as if kept
            "\n\n".join([*note, *(text for _record, _path, text in kept)]),
            kept[0][0].seed if kept else gr.update(),
            gr.update(choices=choices, value=value, info=resolution_words(status, buckets, value)),
            [history.entry(record, path) for record, path, _line in kept],  # for the history
        )

    runs = Runs()  # each session's running Generate, for Stop (web/page/live.py)

    def stopped(request: gr.Request | None = None) -> None:
        """Stop: the session's running Generate ends at once with what it made and where it stopped, in the
        words the server logs (its own last answer); one still in Gradio's queue ends when it starts; with
        nothing running the page stays as it is."""
        session = request.session_hash if request is not None else None
        queued = getattr(getattr(demo, "_queue", None), "pending_event_ids_session", {}).get(session, set())
        runs.stop(session, set(queued))

    def choices_for(status: ManagerStatus, buckets: list[str] | None) -> list[tuple[str, str]]:
        return edit_controls.edit_choices(status, buckets) if buckets else dropdown_choices(status)

    def references_changed(references: Any, current: str | None) -> tuple[Any, ...]:
        """New references: their buckets, and the dropdown labelled for them (`auto` only while there are some)."""
        buckets = edit_controls.reference_buckets(settings, references)
        status = manager.status()
        choices = choices_for(status, buckets)
        values = [value for _label, value in choices]
        value = current if current in values else (edit_controls.AUTO if buckets else (values or [None])[0])
        info = resolution_words(status, buckets, value)
        return buckets, gr.update(choices=choices, value=value, info=info), choices

    def resolution_words(status: ManagerStatus, buckets: list[str] | None, value: str | None) -> str:
        """The dropdown's info line: the edit graph's state with references, else the shape's."""
        if buckets:
            return edit_controls.edit_info(status, buckets, value)
        return shape_info(status.shapes.get(value or ""))

    def refresh(
        current: str | None,
        shown: list[Any] | None,
        buckets: list[str] | None = None,
    ) -> tuple[Any, ...]:
        """The status tick: the status panel, the table and the dropdown's labels."""
        status = manager.status()
        choices = choices_for(status, buckets)
        if choices == shown:
            dropdown = gr.update()  # unchanged: leave the open dropdown alone
        else:
            values = [value for _label, value in choices]
            value = current if current in values else (values or [None])[0]
            dropdown = gr.update(choices=choices, value=value, info=resolution_words(status, buckets, value))
        return status_markdown(status), shapes_table(status), dropdown, choices

    def resolution_info(current: str | None, buckets: list[str] | None = None) -> Any:
        """The chosen shape's long text (state and estimate) in the dropdown's info line."""
        return gr.update(info=resolution_words(manager.status(), buckets, current))

    initial = manager.status()
    offered = [value for _label, value in dropdown_choices(initial)]
    default = settings.default_resolution if settings.default_resolution in offered else (offered or [None])[0]

    with gr.Blocks(
        title="FLUX.2-klein on AWS Trainium", delete_cache=(TEMP_FILE_MAX_AGE_S, TEMP_FILE_MAX_AGE_S)
    ) as demo:
        gr.Markdown(
            "# FLUX.2-klein on AWS Trainium\n"
            "Each resolution is compiled once for the device (minutes on Neuron) and then reused: "
            "the list says which shapes are ready."
        )
        with gr.Row():
            with gr.Column(scale=2):
                prompt = gr.Textbox(
                    label="Prompt",
                    placeholder=settings.prompt_placeholder,  # tiny-shapes: its grammar, in its word order
                    lines=1,
                    max_lines=6,
                    info=page_notes.prompt_info(0, settings.max_prompt_chars),  # counts; says when it cut
                    elem_id="prompt",
                )
                references = edit_controls.reference_input(settings)
                source, strength = painting.source_input(settings)
                with gr.Row():
                    resolution = gr.Dropdown(
                        label="Resolution",
                        choices=dropdown_choices(initial),
                        value=default,
                        info=shape_info(initial.shapes.get(default or "")),
                        elem_id="resolution",
                    )
                    steps = gr.Slider(
                        label="Steps",
                        minimum=1,
                        maximum=settings.max_steps,
                        step=1,
                        value=settings.default_steps,
                        info=page_notes.steps_info(settings.max_steps, settings.model),
                        elem_id="steps",
                    )
                with gr.Row(visible=bool(settings.loras)):  # LoRA styles, switched without recompiling
                    lora = gr.Dropdown(
                        label="Style (LoRA)", choices=["none", *settings.loras], value="none", elem_id="lora"
                    )
                    lora_scale = gr.Slider(
                        label="LoRA scale",
                        minimum=0.0,
                        maximum=settings.max_lora_scale,
                        step=0.05,
                        value=1.0,
                        elem_id="lora-scale",
                    )
                more_styles = lora_controls.extra_pairs(settings)  # one pair per further slot (several at once)
                with gr.Row():
                    seed = gr.Number(label="Seed", value=0, precision=0, minimum=0, maximum=MAX_SEED, elem_id="seed")
                    count = gr.Slider(
                        label="Images",  # seeds seed, seed+1, ...: one after another, no new compile
                        minimum=1,
                        maximum=settings.max_images,
                        step=1,
                        value=1,
                        elem_id="images",
                    )
                    randomize = gr.Checkbox(label="Randomize seed", value=True, elem_id="randomize")
                generate_btn = gr.Button("Generate", variant="primary", elem_id="generate")
                stop_btn = gr.Button("Stop", variant="stop", size="sm", elem_id="stop")  # at the next step
                gr.Examples(examples=[[e] for e in settings.example_prompts], inputs=[prompt])
            with gr.Column(scale=3):
                # Every image whole: contain, not Gradio's cover, and as tall as it is drawn (a fixed height cut a
                # square image's top and bottom off).
                gallery = gr.Gallery(
                    label="Images",
                    format="png",
                    columns=2,
                    object_fit="contain",
                    height="max-content",  # "auto" is Gradio's fixed 550 px; this grows with the images
                    interactive=False,
                    elem_id="gallery",
                )
                info = gr.Markdown(elem_id="info")
                use_btn = gr.Button(
                    "Use as reference", size="sm", visible=settings.max_references > 0, elem_id="use-as-reference"
                )
        with gr.Accordion("Server status", open=True):
            status_md = gr.Markdown(status_markdown(initial), elem_id="status")
            table = gr.Dataframe(
                headers=SHAPE_COLUMNS, value=shapes_table(initial), interactive=False, elem_id="shapes"
            )

        past, last = (
            history.panel(settings.max_references > 0),
            gr.State([]),
        )  # this session's images, and the last Generate's
        shown = gr.State(dropdown_choices(initial))
        buckets = gr.State([])
        page_inputs = [prompt, resolution, steps, seed, count, randomize, lora, lora_scale, references, buckets]
        generated = gr.on(
            [generate_btn.click, prompt.submit],
            lora_controls.with_extra_pairs(ui_generate, len(more_styles)),
            inputs=[*page_inputs, source, strength, *more_styles],
            outputs=[gallery, info, seed, resolution, last],
            concurrency_id=DEVICE_QUEUE,
            concurrency_limit=lanes,
            api_visibility="private",
            show_progress_on=[gallery],  # the seed box keeps its number: no spinner, no error badge on it
        )
        # Stop is the page's own flag (web/page/live.py `Runs`): the request's answer says where it stopped.
        stop_btn.click(stopped, queue=False, api_visibility="private")

        # The public API (web/page/api_endpoints.py): plain inputs, validated by the manager.
        api_endpoints.add(manager, images, run, lanes)

        page_notes.count_prompt(prompt, settings.max_prompt_chars)
        form = [prompt, resolution, steps, seed, randomize, lora, lora_scale]
        history_use = history.wire(generated, past, last, form, references, settings.max_references)
        relabel: dict[str, Any] = {"inputs": [references, resolution], "outputs": [buckets, resolution, shown]}
        relabel |= {"queue": False, "api_visibility": "private", "show_progress": "hidden"}
        references.change(references_changed, **relabel)  # an upload
        use_btn.click(
            lambda refs, out: edit_controls.add_reference(refs, out, settings.max_references),
            inputs=[references, gallery],
            outputs=[references],
            queue=False,
            api_visibility="private",
        ).then(references_changed, **relabel)  # "Use as reference" relabels the shapes as an upload does
        history_use.then(references_changed, **relabel)
        resolution.change(
            resolution_info,
            inputs=[resolution, buckets],
            outputs=[resolution],
            queue=False,
            api_visibility="private",
            show_progress="hidden",
        )
        # Every page opens on the state of now (the values above are the build's: before load_on_start's load).
        demo.load(
            refresh,
            inputs=[resolution, shown, buckets],
            outputs=[status_md, table, resolution, shown],
            queue=False,
            api_visibility="private",
            show_progress="hidden",
        )
        timer = gr.Timer(STATUS_REFRESH_S)
        timer.tick(
            refresh,
            inputs=[resolution, shown, buckets],
            outputs=[status_md, table, resolution, shown],
            queue=False,
            concurrency_limit=None,
            api_visibility="private",
            show_progress="hidden",
        )

    def first_render() -> dict[int, dict[str, Any]]:
        """What a page opens on (web/page/first_render.py): the status panel, the table and the dropdown of now."""
        status = manager.status()
        return {
            status_md._id: {"value": status_markdown(status)},
            table._id: {"value": table.postprocess(shapes_table(status)).model_dump()},
            resolution._id: {"choices": dropdown_choices(status), "info": shape_info(status.shapes.get(default or ""))},
        }

    demo.first_render = first_render  # type: ignore[attr-defined]
    demo.page_css = history.CSS  # type: ignore[attr-defined]
    return demo
