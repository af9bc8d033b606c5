"""What the page shows, as text: labels, status panels and tables rendered from the manager's records.

Pure functions of `ManagerStatus` / `GenerationRecord` (no Gradio), so the page, tests and other front ends
render the same words.
"""

from __future__ import annotations

from typing import Any

from neuron_app.engine.cache import estimate_words
from neuron_app.engine.records import GenerationRecord, ManagerStatus, ShapeState, ShapeStatus

SHAPE_COLUMNS = ["shape", "state", "manifest", "compile s", "graphs", "hits", "cache", "last error"]


def estimate_text(shape: ShapeStatus) -> str:
    """What a compile of this shape should take, from the manifest's history; says so when there is none."""
    return estimate_words(shape.estimate_s)


def shape_label(shape: ShapeStatus, name: str | None = None) -> str:
    """The dropdown label: the shape (or `name`, e.g. an edit layout) and what choosing it will cost."""
    name = name or shape.resolution
    if shape.state is ShapeState.READY:
        return f"{name} - ready"
    if shape.state is ShapeState.COMPILING:
        return f"{name} - compiling now, {estimate_text(shape)}"
    if shape.state is ShapeState.FAILED:
        return f"{name} - failed, will retry"
    if shape.manifest == "precompiled":
        return f"{name} - precompiled, loads from cache, {estimate_text(shape)}"
    return f"{name} - compiles on first use, {estimate_text(shape)}"


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
        f"**Cache** `{status.cache_dir}` ({_human_bytes(status.cache_size_bytes)}) · fingerprint `{status.fingerprint}`"
        f"{lora_markdown(status)}"
    )


def compile_less_markdown(status: ManagerStatus) -> str:
    """How many of the graphs are the VAE's, and what the prompt cache saved (engine/vae.py, prompt_cache.py)."""
    vae = getattr(status, "vae_compiles", 0)
    cache = getattr(status, "prompt_cache", None) or {}
    text = f" (VAE: {vae})" if vae else ""
    if cache.get("size"):
        text += f" · **prompt cache** {cache['hits']} hits, {cache['misses']} misses"
    return text


def lora_markdown(status: ManagerStatus) -> str:
    """The configured LoRA styles with rank and source (nothing when none are configured)."""
    if not status.loras:
        return ""
    rows = ", ".join(f"`{a['name']}` (rank {a['rank'] or '?'}, {a['source']})" for a in status.loras)
    return f"\n\n**LoRA styles** {rows}"


def shapes_table(status: ManagerStatus) -> list[list[Any]]:
    rows = []
    for shape in [*status.shapes.values(), *status.edits.values()]:  # edit graphs: "64x64 + 1 ref (64x64)"
        state = str(shape.state)
        if shape.shared_with:
            state += f" (shares {shape.shared_with})"
        if shape.ready_replicas is not None:
            state += f" on {shape.ready_replicas} replica(s)"
        if shape.state in (ShapeState.NOT_COMPILED, ShapeState.COMPILING):
            state += f", {estimate_text(shape)}"
        rows.append(
            [
                shape.resolution,
                state,
                shape.manifest,
                "" if shape.compile_s is None else f"{shape.compile_s:.2f}",
                shape.graphs,
                shape.hits,
                shape.cache or "",
                shape.last_error or "",
            ]
        )
    return rows


def info_markdown(record: GenerationRecord) -> str:
    if record.compiled:
        source = "from the persistent cache" if record.cache == "disk" else "from scratch"
        compiled = f" · compiled {record.graphs_compiled} graph(s) {source} in {record.compile_s:.2f} s"
    else:
        compiled = ""
    refs = ", ".join(f"{r['size']} → {r['bucket']}" for r in record.references)
    return (
        f"**cache: {record.cache}**{compiled} · inference {record.inference_s:.2f} s"
        f" · {record.resolution}, {record.steps} steps, seed {record.seed}"
        + (f" · LoRA {record.lora} x{record.lora_scale:g}" if record.lora != "none" else "")
        + (f" · references {refs}" if refs else "")
    )
