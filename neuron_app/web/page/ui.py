"""The Gradio page and its public API (`generate`, `edit`, `status`).

`build_ui` takes a manager (the contract in engine/contract.py: in-process or replicas) and never loads a
model itself: everything it shows is data that the manager produced.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import gradio as gr

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
from neuron_app.web.access import Access, entry_of
from neuron_app.web.multi_image import generate_many
from neuron_app.web.page import api_endpoints, edit_controls, history, lora_controls
from neuron_app.web.page import inpaint as painting
from neuron_app.web.page import notes as page_notes
from neuron_app.web.page.api_endpoints import DEVICE_QUEUE
from neuron_app.web.page.live import live
from neuron_app.web.page.views import (
    SHAPE_COLUMNS,
    dropdown_choices,
    info_markdown,
    shape_info,
    shapes_table,
    status_markdown,
    stopped_markdown,
)

log = logging.getLogger(__name__)

STATUS_REFRESH_S = 2.0
#: Stop's notes kept for sessions (one each, until its next Generate); past this the oldest go.
MAX_STOP_NOTES = 1000
#: Gradio's temporary files older than this are deleted, checked as often (seconds).
TEMP_FILE_MAX_AGE_S = 3600


def keep_newest(per_session: dict[Any, Any]) -> None:
    """At most MAX_STOP_NOTES sessions' entries: the oldest go (sessions that left never come back for theirs)."""
    while len(per_session) > MAX_STOP_NOTES:
        per_session.pop(next(iter(per_session)))


def build_ui(manager: Manager, images: ImageStore, access: Access | None = None) -> gr.Blocks:
    settings = manager.settings
    access = access or Access(settings)  # the per-address page limit and the content-refusal counts
    lanes = request_slots(settings)  # one device event per replica, plus the post slots (engine/output/postprocess.py)
    run = api_endpoints.runner(manager, access)

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
        steps_seen.pop(session, None)
        stop_notes.pop(session, None)

        def work(on_event: ProgressCallback) -> list[GenerationRecord]:
            on_event = previews.forward(seen_by(session, on_event))
            with access.page_images_for(request, check_images(count, settings.max_images)):  # per address
                return generate_many(manager, prompt, resolution, steps, seed, count, progress=on_event, **options)

        def line(text: str) -> tuple[Any, ...]:
            return previews.gallery(), text, gr.update(), gr.update(), gr.update()

        try:
            records = yield from live(work, manager.status, api_endpoints.progress_bridge(progress), line)
        except Exception as exc:
            steps_seen.pop(session, None)
            access.observe_error(exc, entry_of(request, "page"))
            error = api_endpoints.user_error(exc)
            yield line(f"**Not generated:** {error.message}")  # the reason stays in the output area, not the seed
            raise error from exc
        steps_seen.pop(session, None)
        paths = [str(images.save(record)) for record in records]
        status = manager.status()
        choices = choices_for(status, buckets)
        value = resolution if resolution == edit_controls.AUTO else records[0].resolution
        yield (
            paths,
            "\n\n".join(info_markdown(record) for record in records),
            records[0].seed,
            gr.update(choices=choices, value=value, info=shape_info(status.shapes.get(value))),
            [history.entry(record, path) for record, path in zip(records, paths, strict=True)],  # for the history
        )

    steps_seen: dict[str | None, ProgressEvent] = {}  # each session's running request's last event, for Stop
    stop_notes: dict[str | None, str] = {}  # what Stop said, until the session's next Generate (the status tick)

    def seen_by(session: str | None, forward: ProgressCallback) -> ProgressCallback:
        def on_event(event: ProgressEvent) -> None:
            steps_seen[session] = event
            keep_newest(steps_seen)  # a request whose page left without Stop leaves its last event here
            forward(event)

        return on_event

    def stopped(request: gr.Request | None = None) -> tuple[Any, str]:
        """Stop's own answer: it replaces the cancelled event's state on the gallery (no "Error" badge) and says
        where the request stopped, in the words the server logs."""
        session = request.session_hash if request is not None else None
        event = steps_seen.pop(session, None)
        note = stop_notes[session] = stopped_markdown(event)
        keep_newest(stop_notes)  # sessions that left: the oldest note goes
        return (gr.update() if event is None else []), note  # no preview left as if it were kept

    def choices_for(status: ManagerStatus, buckets: list[str] | None) -> list[tuple[str, str]]:
        return edit_controls.edit_choices(status, buckets) if buckets else dropdown_choices(status)

    def references_changed(references: Any, current: str | None) -> tuple[Any, ...]:
        """New references: their buckets, and the dropdown labelled for them (`auto` only while there are some)."""
        buckets = edit_controls.reference_buckets(settings, references)
        choices = choices_for(manager.status(), buckets)
        values = [value for _label, value in choices]
        value = current if current in values else (edit_controls.AUTO if buckets else (values or [None])[0])
        return buckets, gr.update(choices=choices, value=value), choices

    def refresh(
        current: str | None,
        shown: list[Any] | None,
        buckets: list[str] | None = None,
        request: gr.Request | None = None,
    ) -> tuple[Any, ...]:
        """The status tick; it also says again what Stop said, since a cancelled request's last progress line can
        reach the page after Stop's own answer and cover it."""
        note = stop_notes.get(request.session_hash) if request is not None else None
        status = manager.status()
        choices = choices_for(status, buckets)
        if choices == shown:
            dropdown = gr.update()  # unchanged: leave the open dropdown alone
        else:
            values = [value for _label, value in choices]
            value = current if current in values else (values or [None])[0]
            dropdown = gr.update(choices=choices, value=value, info=shape_info(status.shapes.get(value)))
        return status_markdown(status), shapes_table(status), dropdown, choices, (gr.update() if note is None else note)

    def resolution_info(current: str | None) -> Any:
        """The chosen shape's long text (state and estimate) in the dropdown's info line."""
        return gr.update(info=shape_info(manager.status().shapes.get(current or "")))

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
                        info=page_notes.steps_info(settings.max_steps),
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
                gallery = gr.Gallery(label="Images", format="png", columns=2, interactive=False, elem_id="gallery")
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
        # Gradio closes the request's generator (web/page/live.py); Stop's own answer says where it stopped.
        stop_btn.click(stopped, outputs=[gallery, info], cancels=[generated], queue=False, api_visibility="private")

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
            inputs=[resolution],
            outputs=[resolution],
            queue=False,
            api_visibility="private",
            show_progress="hidden",
        )
        # Every page opens on the state of now (the values above are the build's: before load_on_start's load).
        demo.load(
            refresh,
            inputs=[resolution, shown, buckets],
            outputs=[status_md, table, resolution, shown, info],
            queue=False,
            api_visibility="private",
            show_progress="hidden",
        )
        timer = gr.Timer(STATUS_REFRESH_S)
        timer.tick(
            refresh,
            inputs=[resolution, shown, buckets],
            outputs=[status_md, table, resolution, shown, info],
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
