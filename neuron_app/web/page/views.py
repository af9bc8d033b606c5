"""What the page shows, as text: labels, status panels and tables rendered from the manager's records.

Pure functions of `ManagerStatus` / `GenerationRecord` (no Gradio), so the page, tests and other front ends
render the same words.
"""

from __future__ import annotations

from typing import Any

from neuron_app.engine.cache.estimates import Estimate, elapsed_words, human_seconds
from neuron_app.engine.records import GenerationRecord, ManagerStatus, ProgressEvent, ShapeState, ShapeStatus, Usage

SHAPE_COLUMNS = ["shape", "state", "estimate", "manifest", "compile s", "graphs", "hits", "cache", "last error"]
#: The manifest's verdicts in words (engine/cache/manifest.py Validity): an entry is written by `precompile` and by
#: a first-use compile alike, so the table says where the graphs are, not how they got there.
MANIFEST_WORDS = {"precompiled": "in the cache", "stale": "stale (other settings)", "absent": "not in the cache"}


def state_word(shape: ShapeStatus) -> str:
    """The short word for a shape's state, the same in the dropdown, the table and the progress line."""
    if shape.state is ShapeState.READY:
        return "ready"
    if shape.state is ShapeState.COMPILING:
        return "loading" if _is_load(shape) else "compiling"
    if shape.state is ShapeState.FAILED:
        return "failed"
    return "precompiled" if shape.manifest == "precompiled" else "not compiled"


def _is_load(shape: ShapeStatus) -> bool:
    return shape.estimate.kind == "load" if shape.estimate is not None else shape.manifest == "precompiled"


def estimate_text(shape: ShapeStatus) -> str:
    """What making the shape ready should take and how sure that is (engine/cache/estimates.py `estimate`)."""
    return estimate_phrase(shape.estimate, _is_load(shape), shape.estimate_s)


def estimate_phrase(found: Estimate | None, load: bool, seconds: float | None = None) -> str:
    """`estimate_text` for any graph (a shape's row, or an edit graph's compile event)."""
    verb = "loads from the cache" if load else "compiles"
    if found is None:
        if seconds is None:  # e.g. merged from replicas: the seconds without their basis
            return f"{verb}; no history for an estimate"
        return f"{verb} in about {human_seconds(seconds)}"
    bound = "at most" if found.sure == "upper bound" else "about"
    sure = ", rough" if found.sure == "rough" else ""  # the basis says the rest ("measured", "scaled from ...")
    return f"{verb} in {bound} {human_seconds(found.seconds)} ({found.basis}{sure})"


def short_estimate(shape: ShapeStatus) -> str:
    """`~33 s` for a label, empty without history or once ready."""
    if shape.state is ShapeState.READY or shape.estimate_s is None:
        return ""
    return f", ~{human_seconds(shape.estimate_s)}"


def shape_label(shape: ShapeStatus, name: str | None = None) -> str:
    """The dropdown label: the shape (or `name`, e.g. an edit layout), its state word and a short estimate; the
    long text is the dropdown's info line (`shape_info`)."""
    word = "failed, will retry" if shape.state is ShapeState.FAILED else state_word(shape)
    return f"{name or shape.resolution} - {word}{short_estimate(shape)}"


def shape_info(shape: ShapeStatus | None, name: str | None = None) -> str:
    """The dropdown's info line for the chosen shape: its state and, until it is ready, the estimate in full."""
    if shape is None:
        return "Each shape compiles once for the device (minutes on Neuron), then every request reuses it."
    name = name or shape.resolution
    if shape.state is ShapeState.READY:
        return f"{name} is ready: no compile" + (f" (shares {shape.shared_with}'s graph)" if shape.shared_with else "")
    if shape.state is ShapeState.FAILED:
        return f"{name} failed ({shape.last_error or 'see the log'}); the next request retries: {estimate_text(shape)}"
    return f"{name} is {state_word(shape)}: the first request {estimate_text(shape)}; later ones reuse it"


def stopped_markdown(event: ProgressEvent | None, kept: int = 0, images: int = 1) -> str:
    """The output area after the page's Stop: where the request stopped, as the server counts it (the work ends at
    the end of the step running when Stop was pressed; a compile or a load goes on, kept for later requests), and
    what was kept: the images of a several-image request finished before it."""
    which = f" (image {kept + 1} of {images})" if images > 1 else ""
    name = f"**{event.resolution} - stopped" if event is not None and event.resolution else "**Stopped"
    phase = event.phase if event is not None else None
    if event is not None and phase == "denoising":
        where = f" at step {min(event.step + 1, event.total)} of {event.total}**{which}"
    elif phase == "decoding":
        where = f"** while decoding{which}"
    elif phase == "compiling":
        where = f"** during its first-use compile{which}, which goes on and is kept for later requests"
    elif phase == "loading":
        where = "** while the model loads, which goes on"
    else:  # no event yet: its request waited for the device, behind others
        where = "** while waiting for the device"
    made = f"{kept} image(s) finished before it are kept below" if kept else "no image was made"
    if phase in ("denoising", "decoding") and not kept:
        made = "no image was kept"
    return f"{name}{where}: {made}."


def waiting_markdown(figures: dict[str, Any], status: ManagerStatus, elapsed_s: float) -> str | None:
    """The output area while a request waits for the device behind others: its place and ETA as the API gives
    them (web/queue_place.py `figures`), and what the device is doing (a compile ahead is the long wait)."""
    ahead = figures.get("queue_position") or 0
    if ahead < 1:
        return None
    eta = figures.get("queue_eta_s")
    line = f"**Waiting for the device** · {ahead} request{'s' if ahead > 1 else ''} ahead of this one"
    line += f" · ETA ~{human_seconds(eta)}" if eta is not None else " · no ETA yet (no request timed)"
    busy = [name for name, shape in status.shapes.items() if shape.state is ShapeState.COMPILING]
    if busy:
        line += f" · {', '.join(busy)} compiling"
    return f"{line} · {elapsed_words(elapsed_s)} elapsed"


def progress_markdown(
    event: ProgressEvent, shape: ShapeStatus | None, elapsed_s: float, compiled_s: float | None = None
) -> str:
    """The output area while a request runs, from the manager's progress event and the shape's status record:
    the shape, what happens ("compiling (first use)" with the estimate, then the steps) and for how long."""
    name = event.resolution or ""
    took = f"{elapsed_words(elapsed_s)} elapsed"
    if event.phase == "loading":
        found = event.estimate
        about = f" (~{human_seconds(found.seconds)})" if found is not None else " (first request; no load measured yet)"
        return f"**Loading the model{about}** · {took}"
    if event.phase == "compiling":
        if event.graph and event.graph != name:  # an edit graph: its own compile, not the shape's row
            name, found = event.graph, event.estimate
            load = found is not None and found.kind == "load"
            estimate = estimate_phrase(found, load)
        else:
            load = shape is not None and _is_load(shape)
            estimate = estimate_text(shape) if shape is not None else "no history for an estimate"
        what = "loading its precompiled graph (first use)" if load else "compiling (first use)"
        return (
            f"**{name} - {what}** · {took} · {estimate}\n\n"
            "Each shape compiles once (minutes on Neuron); later requests reuse it."
        )
    done = f" · made ready in {human_seconds(compiled_s)} (first use)" if compiled_s is not None else ""
    if event.phase == "denoising":
        return f"**{name} - step {event.step}/{event.total}**{done}"
    if event.phase == "decoding":
        return f"**{name} - decoding**{done}"
    return f"**{name} - {event.message or event.phase}** · {took}"


def dropdown_choices(status: ManagerStatus) -> list[tuple[str, str]]:
    """The shapes on offer (all configured, or only precompiled ones), labelled with their state."""
    return [(shape_label(shape), name) for name, shape in status.shapes.items() if shape.offered]


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GB"


def status_markdown(status: ManagerStatus) -> str:
    if status.loaded:
        model_state = f"loaded in {status.load_s:.1f} s"
    elif status.loading:
        model_state = "loading..."
    elif status.load_error:
        model_state = f"failed to load: {status.load_error}"
    else:
        model_state = "loads on the first request"
    warm = status.warmup
    warm_line = ""
    if warm["mode"] != "none":
        state = "running" if warm["running"] else "finished"
        warm_line = f" · warm-up ({warm['mode']}): {state}, {len(warm['done'])} done, {len(warm['pending'])} pending"
    return (
        f"**Device** {status.device} · **dtype** {status.dtype} · **compile** {status.compile_mode}"
        f" / {status.compile_backend} · **TP** {status.tp_degree} · **fallback** {status.fallback or '-'}\n\n"
        f"**Model** `{status.model}` ({model_state}) · **graphs compiled** {status.compiles}"
        f"{compile_less_markdown(status)}{warm_line}\n\n"
        f"**Cache** `{status.cache_dir}` ({_human_bytes(status.cache_size_bytes)}; {CACHE_NOTE})"
        f" · fingerprint `{status.fingerprint}`"
        f"{remote_markdown(status)}"
        f"{plan_markdown(status)}"
        f"{lora_markdown(status)}{safety_markdown(status)}{neuron_markdown(status)}"
    )


def plan_markdown(status: ManagerStatus) -> str:
    """What the real model needs per core and how fast it can be, from `plan`, before any compile; which core
    holds which component (the `placement` setting)."""
    plan = f"\n\n**Plan** (trn2, TP {status.tp_degree}) {status.plan}" if status.plan else ""
    return plan + placement_markdown(status.placement)


def placement_markdown(placement: dict[str, Any]) -> str:
    """ "**Placement** text-encoder-apart: transformer on NeuronCore 0, text encoder on 1, VAE on 0"."""
    if not placement or not placement.get("cores", {}).get("transformer"):
        return ""
    held = ", ".join(
        f"{name.replace('_', ' ')} on {'/'.join(map(str, cores))}" for name, cores in placement["cores"].items()
    )
    setting = "" if placement["setting"] == placement["name"] else f" ({placement['setting']})"
    return f"\n\n**Placement** {placement['name']}{setting}: cores {held}"


#: Answers show the cache folder as `/@cache` (the door rewrites server paths on the way out): say what it is.
CACHE_NOTE = "the cache folder, NEURON_APP_CACHE_DIR: ~/.cache/neuron-app unless set"


def neuron_markdown(status: ManagerStatus) -> str:
    """Eager compiles (Neuron compiles each op signature once) and, on neuron-emulated, the rules' record."""
    rules = status.neuron_rules
    degraded = [name for name, shape in status.shapes.items() if shape.degraded]
    text = f"\n\n**Eager ops compiled** {status.eager_compiles}" if status.eager_compiles or rules else ""
    if degraded:
        text += f" · **degraded** (ops ran on the CPU): {', '.join(degraded)}"
    judged = {name: shape.nki_attention for name, shape in status.shapes.items() if shape.nki_attention is not None}
    if judged:
        yes = [name for name, nki in judged.items() if nki]
        no = [name for name, nki in judged.items() if not nki]
        how = " (predicted by TorchNeuron's gate: no kernel runs on the emulator)" if rules else ""
        text += f"\n\n**NKI attention{how}** yes: {', '.join(yes) or '-'}"
        text += f" · no (decomposed, slower): {', '.join(no) or '-'}"
    if rules:
        text += (
            f" · **neuron rules** ({rules['mode']}): {rules['violation_count']} violation(s), "
            f"{rules['eager_signatures']} op signatures"
        )
        if rules["violations"]:
            text += f" · last: `{rules['violations'][-1][:160]}`"
    return text


def safety_markdown(status: ManagerStatus) -> str:
    """The safety checker's state and counts (engine/trust/safety.py)."""
    safety = status.safety or {}
    if safety.get("checker") != "on":
        return "\n\n**Safety checker** off" if safety else ""
    if safety.get("error"):
        return f"\n\n**Safety checker** on, **not loaded**: {safety['error']}. Every request is refused."
    where = " on the device" if safety.get("device") == "device" else ""
    counts = f"{safety['passed']} passed, {safety['flagged']} refused"
    return f"\n\n**Safety checker** on{where} (`{safety['model']}`): {counts}"


def compile_less_markdown(status: ManagerStatus) -> str:
    """How many of the graphs are the VAE's, and what the prompt cache saved (engine/model/vae.py, prompt_cache.py)."""
    vae, cache = status.vae_compiles, status.prompt_cache
    text = f" (VAE: {vae})" if vae else ""
    if cache.get("size"):
        text += f" · **prompt cache** {cache['hits']} hits, {cache['misses']} misses"
    return text


def lora_words(record: GenerationRecord) -> str:
    """The styles of an image, in its result line: ` · LoRA red x1 + blue x0.5` (nothing without one)."""
    styles = record.loras or ([{"name": record.lora, "scale": record.lora_scale}] if record.lora != "none" else [])
    return " · LoRA " + " + ".join(f"{s['name']} x{s['scale']:g}" for s in styles) if styles else ""


def lora_markdown(status: ManagerStatus) -> str:
    """The configured LoRA styles with rank and source (nothing when none are configured)."""
    if not status.loras:
        return ""
    rows = ", ".join(f"`{a['name']}` (rank {a['rank'] or '?'}, {a['source']})" for a in status.loras)
    return f"\n\n**LoRA styles** {rows}"


def shapes_table(status: ManagerStatus) -> list[list[Any]]:
    """One row per shape and edit graph, in the dropdown's words (`state_word`, `estimate_text`)."""
    rows = []
    for shape in [*status.shapes.values(), *status.edits.values()]:  # edit graphs: "64x64 + 1 ref (64x64)"
        state = state_word(shape)
        if shape.shared_with:
            state += f" (shares {shape.shared_with})"
        if shape.ready_replicas is not None:
            state += f" on {shape.ready_replicas} replica(s)"
        rows.append(
            [
                shape.resolution,
                state,
                "" if shape.state is ShapeState.READY else estimate_text(shape),
                MANIFEST_WORDS.get(shape.manifest, shape.manifest),
                compile_cell(shape),
                shape.graphs,
                shape.hits,
                shape.cache or "",
                shape.last_error or "",
            ]
        )
    return rows


def compile_cell(shape: ShapeStatus) -> str:
    """The seconds its compile took; with no graph of its own (its token family's was there), they were a run at
    the shape and nothing compiled, which the cell says rather than `16.55` beside `graphs 0`."""
    if shape.compile_s is None:
        return ""
    if shape.graphs == 0 and not shape.eager_compiles and shape.cache in ("memory", None):
        return f"{shape.compile_s:.2f} (a run: no new graph)"
    return f"{shape.compile_s:.2f}"


def remote_markdown(status: ManagerStatus) -> str:
    """What cache_remote (S3) gave this process (engine/remote/cache.py); empty when it is off."""
    remote = status.remote or {}
    if not remote:
        return ""
    if remote.get("last_pull_at") is None:
        text = f" · **remote** `{remote['url']}`: not pulled yet"
    else:
        size = _human_bytes(remote.get("bytes_pulled", 0))
        text = f" · **remote** `{remote['url']}`: {remote.get('objects_pulled', 0)} objects ({size}) pulled"
        text += f", last pull {remote['last_pull_at']}"
    if remote.get("shapes_pulled"):
        text += f", shapes {', '.join(remote['shapes_pulled'])}"
    if remote.get("ignored"):
        text += f", {remote['ignored']} objects ignored (see the log)"
    if remote.get("last_error"):
        text += f", last error: {remote['last_error']}"
    return text


def source_words(source: dict[str, Any] | None) -> str:
    """What an inpaint or image-to-image started from: the source's size, the mask's share, the strength."""
    if not source:
        return ""
    if source.get("masked"):
        what = f"inpaint of a {source['size']} source, mask {100 * source['edit_fraction']:.0f}% of the image"
    else:
        what = f"image-to-image from a {source['size']} source"
    return f" · {what}, strength {source.get('strength', 1.0):g}"


def info_markdown(record: GenerationRecord) -> str:
    if record.compiled:  # a disk or remote hit is a load of graphs compiled before, not a compile
        words = {"disk": "loaded {} graph(s) from the persistent cache", "remote": "loaded {} graph(s) pulled from "
                 "cache_remote"}  # fmt: skip
        done = words.get(str(record.cache), "compiled {} graph(s)").format(record.graphs_compiled)
        compiled = f" · {done} in {record.compile_s:.2f} s"
    else:
        compiled = ""
    refs = ", ".join(f"{r['size']} → {r['bucket']}" for r in record.references)
    short = (
        f"**cache: {record.cache}**{compiled} · inference {record.inference_s:.2f} s"
        f" · {record.resolution}, {record.steps} steps, seed {record.seed}"
        + lora_words(record)
        + (f" · references {refs}" if refs else "")
        + source_words(record.source)
        + (f" · resized to {record.resized_to} (size_policy nearest)" if record.resized_to else "")
    )
    details = (
        f"safety {record.safety}"
        + marks_words(record.marks)
        + (f" · {record.eager_compiles} eager op(s) compiled" if record.eager_compiles else "")
    )
    # The short line for people; the rest, with the API's `usage` fields as they are named there, one click away.
    return f"{short}\n\n<details><summary>details</summary>\n\n{details}\n\n{usage_line(record.usage())}\n\n</details>"


def marks_words(marks: dict[str, str]) -> str:
    """The marks the PNG carries, and those it does not and why (`watermark: none: 128x128 is under 256x256, ...`
    below the watermark's 256 px): ` · marked: c2pa, iptc (no watermark: 128x128 is under 256x256)`."""
    carried = [name for name, how in sorted(marks.items()) if not str(how).startswith("none")]
    absent = [f"no {name}: {str(how).removeprefix('none: ').split(',')[0]}" for name, how in sorted(marks.items())
              if str(how).startswith("none")]  # fmt: skip
    if not marks:
        return ""
    return f" · marked: {', '.join(carried) or 'nothing'}" + (f" ({'; '.join(absent)})" if absent else "")


def usage_line(usage: Usage) -> str:
    """The page's usage line: the same fields as the API's `usage`."""
    return "usage: " + ", ".join(f"{name} {value}" for name, value in usage.to_dict().items())
