"""`python -m neuron_app.bench.studies.quality`: what tiny-shapes draws, read back by the judge, on this host's CPU.

- prompt accuracy (background, colour, shape, position) over the 12 fixed prompts at each served shape, at 1, 2, 4
  and 8 steps, through the manager (eager: the numbers do not depend on a compile);
- the tiled VAE against the whole decode: PSNR per tile size and overlap, on the trained VAE;
- seconds per image beside the random `tiny` model.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench import script
from neuron_app.bench.common import seconds

TITLE = "What tiny-shapes draws: prompt accuracy, the tiled VAE's seams, seconds per image"
SHAPES = ["128x128", "256x256", "256x128", "128x256", "64x64"]
FIELDS = ("background", "colour", "shape", "position")


def _manager(model: str, cache: Path, **extra: Any) -> Any:
    fields = {"compile_mode": "eager", "compile_backend": None, "default_resolution": "128x128", "max_steps": 8}
    return script.tiny_manager(SHAPES, cache, model=model, max_sequence_length=32, **fields, **extra)


def accuracy(manager: Any, steps_list: list[int]) -> dict[str, dict[str, int]]:
    from neuron_app.engine.model.shapes_world import EVAL_SCENES, judge

    table = {}
    for shape in SHAPES:
        for steps in steps_list:
            counts = dict.fromkeys(FIELDS, 0)
            for i, scene in enumerate(EVAL_SCENES):
                for key, ok in (
                    judge(manager.generate(scene.prompt, shape, steps, 100 + i).image).matches(scene).items()
                ):
                    counts[key] += ok
            table[f"{shape}/{steps}"] = counts
    return table


def tile_psnr(manager: Any) -> dict[str, float]:
    """Mean PSNR (dB) of the tiled decode against the whole decode at 256x256, over a few scenes."""
    import torch

    from neuron_app.engine.model.shapes_world import EVAL_SCENES, render
    from neuron_app.engine.model.vae import TiledDecoder, TileSpec, psnr

    pipe = manager.pipe
    results: dict[str, list[float]] = {}
    with torch.inference_mode():
        for scene in EVAL_SCENES[::3]:
            x = pipe.image_processor.preprocess(render(scene, 256, 256), height=256, width=256)
            z = pipe.vae.encode(x).latent_dist.mode()
            whole = pipe.image_processor.postprocess(pipe.vae.decode(z).sample)[0]
            for tile, overlap in ((8, 2), (8, 4), (16, 4), (16, 8), (24, 8)):
                tiled = TiledDecoder(pipe.vae, TileSpec(tile, overlap)).decode(z).sample
                close = psnr(whole, pipe.image_processor.postprocess(tiled)[0])
                results.setdefault(f"{tile * 8} px / {overlap * 8} px", []).append(close)
    return {key: round(statistics.mean(values), 1) for key, values in results.items()}


def seconds_per_image(manager: Any, repeats: int) -> float:
    manager.generate("warm", "128x128", 4, 0)
    generate = functools.partial(manager.generate, "a red circle on a blue background", "128x128", 4)
    return statistics.median(seconds(generate, range(repeats)))


def training() -> dict[str, Any]:
    """The shipped model's recipe and runs (neuron_app/models/tiny-shapes/tiny_recipe.json)."""
    import json

    from neuron_app.settings import shipped_model

    return json.loads((shipped_model("tiny-shapes") / "tiny_recipe.json").read_text())


#: The plan's knobs a run's row shows (older runs' recipes lack the later ones: shown as -).
KNOBS = ("seed", "lr", "sampler_share", "edit_weight", "mismatch_share", "bf16_share")


def _training_lines(summary: dict[str, Any]) -> list[str]:
    recipe, rows = summary["recipe"], []
    for i, run in enumerate(summary["runs"], 1):
        plan, shares = run["plan"], run["plan"]["shares"]
        kind = "continued from the run before (VAE kept)" if plan.get("init") else "from scratch"
        stages = f"{shares['vae']} / {shares['lora']}" if not plan.get("init") else f"- / {shares['lora']}"
        knobs = ", ".join(f"{k} {plan.get(k, '-')}" for k in KNOBS)
        verdict = ", ".join(f"{k} {v}" for k, v in run["eval_128x128_4_steps"].items())
        rows.append([f"{i}: {kind}", plan["minutes"], stages, knobs, run["train_s"], run["torch_threads"]])
        rows[-1] += [run.get("machine", "-"), verdict]
    head = ["run", "budget (min)", "VAE / LoRA share", "plan", "took (s)", "torch threads", "machine"]
    lora = [f"The outline LoRA shipped: {summary['outline_lora']}.", ""] if "outline_lora" in summary else []
    return [
        f"**Training** (`python -m neuron_app train-tiny`, docs/tiny-shapes.md): transformer {recipe['double_blocks']} "
        f"double + {recipe['single_blocks']} single blocks, {recipe['heads']} heads of {recipe['head_dim']}; Qwen3 "
        f"{recipe['text_layers']} layers of {recipe['text_hidden']}; VAE widths {recipe['vae_widths']}, "
        f"{recipe['latent_channels']} latent channels; words as tokens.",
        "",
        md.table([*head, "judge at 128x128, 4 steps (of 12)"], rows),
        "",
        *lora,
    ]


def render(report: dict[str, Any], command: str) -> str:
    rows = [
        [shape, steps, *(report["accuracy"][f"{shape}/{steps}"][f] for f in FIELDS)]
        for shape in SHAPES
        for steps in report["steps"]
    ]
    seconds_head = ["model", "seconds per 128x128 image, 4 steps, eager (median)"]
    return "\n".join(
        [
            *_training_lines(report["training"]),
            f"Command: `{command}`. The judge (neuron_app/engine/model/shapes_world.py) reads each image back; counts "
            f"are out of {report['prompts']} prompts (the fixed set: every colour as shape and background, every shape "
            "four times, four positions), seeds 100-111.",
            "",
            md.table(["shape", "steps", *FIELDS], rows),
            "",
            "Tiled VAE against the whole decode at 256x256 (mean PSNR over 4 scenes; the app's Neuron default "
            "is a 256 px tile with 64 px overlap, the tests' tiny shapes use smaller ones):",
            "",
            md.table(["tile / overlap", "PSNR (dB)"], list(map(list, report["tiles"].items()))),
            "",
            md.table(seconds_head, [[name, f"{value:.3f}"] for name, value in report["seconds"].items()]),
        ]
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from neuron_app.engine.model.shapes_world import EVAL_SCENES

    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        shapes = _manager("tiny-shapes", Path(tmp))
        report = {"steps": args.steps, "prompts": len(EVAL_SCENES), "training": training()}
        report["accuracy"] = accuracy(shapes, args.steps)
        report["tiles"] = tile_psnr(shapes)
        report["seconds"] = {"tiny-shapes": seconds_per_image(shapes, args.repeats)}
        report["seconds"]["tiny"] = seconds_per_image(_manager("tiny", Path(tmp)), args.repeats)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = script.parser("studies.quality", __doc__, "also write the section (benchmarks/quality.json)")
    parser.add_argument("--steps", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    return script.main("studies.quality", TITLE, parser, measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
