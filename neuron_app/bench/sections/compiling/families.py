"""Bench section `families`: graphs compiled for the default shapes, the VAE compiled per latent shape (what a
static-shape compiler pays today) beside the tiled VAE (one graph); and the prompt cache's saving.
"""

from __future__ import annotations

from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import (
    OTHER_PROMPT,
    PROMPT,
    facts,
    ratio,
    seconds,
    summarize,
    timed_generate,
    worker_manager,
)
from neuron_app.shapes import Resolution

KIND = "families"
TITLE = "10. Token families, the tiled VAE and the prompt cache"


def family_shapes(harness: Any) -> tuple[list[str], int, int]:
    """The seven default shapes and VAE tile, or for the tiny models all of them divided by 4 (every side
    stays a multiple of 16 and the three token families stay families); the smoke run: three small shapes."""
    from neuron_app.settings import Settings

    defaults = Settings.model_fields
    shapes = list(defaults["resolutions"].default)
    tile, overlap = defaults["vae_tile"].default, defaults["vae_tile_overlap"].default
    if harness.cfg.smoke:
        return ["64x64", "128x64", "64x128"], 8, 2
    if harness.cfg.is_tiny:
        shapes = [f"{r.width // 4}x{r.height // 4}" for r in map(Resolution.parse, shapes)]
        tile, overlap = tile // 4, overlap // 4
    return shapes, tile, overlap


def section(harness: Any) -> dict[str, Any]:
    shapes, tile, overlap = family_shapes(harness)
    mode = "full" if "full" in harness.cfg.modes else harness.cfg.serving_mode
    paths = {}
    for path in ("whole-vae", "tiled-vae"):
        extra = {"resolutions": shapes, "default_resolution": shapes[0], "vae_tile": tile}
        extra |= {"vae_tile_overlap": overlap, "vae_compile": "on" if path == "tiled-vae" else "off"}
        paths[path] = harness.measure(f"families-{path}", "families", mode, extra, path=path, shapes=shapes)
    families = len({Resolution.parse(s).image_tokens for s in shapes})
    tiled = paths["tiled-vae"]
    ok = tiled["transformer_graphs"] == families and tiled["vae_graphs"] == 1
    result = {"shapes": shapes, "tile": tile, "overlap": overlap, "mode": mode, "families": families}
    return result | {"paths": paths, "ok": ok}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Every shape on one VAE path (`whole-vae`: the decoder compiled on the whole latent, one graph per latent
    shape; `tiled-vae`: one tile graph for all), transformer and VAE graphs counted apart; then, on the last
    shape, the text encoder's share of a generation and what the prompt cache saves."""
    manager = worker_manager(spec)
    pipe = manager.pipe
    if spec["path"] == "whole-vae":
        pipe.vae.decoder.compile(backend=manager.vae_counter, fullgraph=True, dynamic=False)
    rows = []
    for shape in spec["shapes"]:
        total, vae = manager.counter.graphs, manager.vae_counter.graphs
        outcome = manager.compile_shape(shape)
        timed_generate(manager, shape, 1, 0)  # the request itself: a shape that shares a graph compiles nothing
        vae_graphs = manager.vae_counter.graphs - vae
        row = {"shape": shape, "tokens": Resolution.parse(shape).image_tokens}
        row |= {"transformer_graphs": (manager.counter.graphs - total) - vae_graphs, "vae_graphs": vae_graphs}
        rows.append(row | {"compile_s": outcome.compile_s, "cache": str(outcome.cache)})
    shape, steps, repeats = spec["shapes"][-1], spec["steps"], spec["repeats"]
    length = manager.settings.max_sequence_length
    encode = seconds(lambda i: pipe.encode_prompt(prompt=f"{PROMPT} {i}", max_sequence_length=length), range(repeats))
    misses = [timed_generate(manager, shape, steps, 0, f"{OTHER_PROMPT} {i}")[0] for i in range(repeats)]
    hits = [timed_generate(manager, shape, steps, seed, OTHER_PROMPT + " 0")[0] for seed in range(1, repeats + 1)]
    status = manager.status()
    return facts(manager) | {
        "path": spec["path"],
        "rows": rows,
        "transformer_graphs": status.compiles - manager.vae_counter.graphs,
        "vae_graphs": manager.vae_counter.graphs,
        "compile_s": sum(r["compile_s"] for r in rows),
        "encode": summarize(encode),
        "generate_miss": summarize(misses),
        "generate_hit": summarize(hits),
        "prompt_cache": status.prompt_cache,
    }


COLUMNS = [
    ("path", "path"),
    ("transformer graphs", "transformer_graphs"),
    ("VAE graphs", "vae_graphs"),
    ("compile s (all shapes)", "compile_s", md.s),
    ("encode ms", "encode.median_s", md.ms),
    ("generate, new prompt ms", "generate_miss.median_s", md.ms),
    ("generate, cached prompt ms", "generate_hit.median_s", md.ms),
    ("cached / new", "cached_over_new", md.x),
]


def render(sec: dict[str, Any]) -> str:
    labels = {"whole-vae": "VAE compiled whole (one graph per latent shape)", "tiled-vae": "tiled VAE (vae_compile on)"}
    rows = [
        run
        | {
            "path": labels.get(path, path),
            "cached_over_new": ratio(run["generate_hit"]["median_s"], run["generate_miss"]["median_s"]),
        }
        for path, run in sec["paths"].items()
    ]
    verdict = "yes" if sec["ok"] else "NO"
    return (
        f"The {len(sec['shapes'])} shapes {', '.join(sec['shapes'])} ({sec['families']} token families), "
        f"mode {sec['mode']}, VAE tile {sec['tile']} latent px, overlap {sec['overlap']}; each path in a fresh "
        f"process and an empty cache folder. Tiled path compiles one transformer graph per family and one VAE "
        f"graph: {verdict}. Then, on the last shape: the text encoder alone, a generation with a new prompt "
        "(cache miss) and with a repeated one (hit: the encoder is skipped).\n\n" + md.columns(COLUMNS, rows)
    )
