"""`python -m neuron_app.bench.studies.klein_modes`: what klein's extra modes cost, measured on the host.

- text encoder: parameters (exact, at Qwen3-4B's real geometry, built on the meta device) and prompt-encode time
  before and after `engine/model/text_encoder.py` cuts the layers klein never reads (timed at a narrower Qwen3 with
  Qwen3-4B's depth and vocabulary: the 2-core CI host cannot hold 4B parameters twice);
- previews: the host-side latent-to-RGB preview per denoising step (`engine/modes/previews.py`), at serving shapes.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench import script
from neuron_app.bench.common import seconds

#: Qwen3-4B (FLUX.2-klein-4B's text encoder), from its config.json.
QWEN3_4B = {
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}
#: Timed stand-in: Qwen3-4B's depth, vocabulary and head layout at 1024 wide.
NARROW = QWEN3_4B | {"hidden_size": 1024, "intermediate_size": 3840, "num_attention_heads": 8, "num_key_value_heads": 2}
READ = (9, 18, 27)
TITLE = "klein's extra modes on the host: the truncated text encoder, live step previews"


def _qwen3(geometry: dict[str, Any], meta: bool = False) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(max_position_embeddings=4096, **geometry)
    if meta:
        with torch.device("meta"):
            return Qwen3ForCausalLM(config)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def _params(module: Any) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def _time_encode(encoder: Any, tokens: int, repeats: int) -> list[float]:
    import torch

    ids = torch.randint(0, encoder.config.vocab_size, (1, tokens))
    mask = torch.ones_like(ids)
    with torch.inference_mode():

        def encode(_: int) -> Any:
            return encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)

        torch.stack([encode(0).hidden_states[k] for k in READ])  # warms allocators up; what klein reads is there
        return seconds(encode, range(repeats))


def bench_text_encoder(tokens: int, repeats: int) -> dict[str, Any]:
    import torch

    from neuron_app.engine.model.text_encoder import truncate_text_encoder

    real = _qwen3(QWEN3_4B, meta=True)
    real_before, layer = _params(real), _params(real.model.layers[0])
    truncate_text_encoder(real, READ)
    real_after = _params(real)
    head = 2 * QWEN3_4B["hidden_size"] * QWEN3_4B["vocab_size"]  # the lm_head matmul, per token
    flops_before, flops_after = 2 * layer * QWEN3_4B["num_hidden_layers"] + head, 2 * layer * max(READ)
    full = _qwen3(NARROW)
    short = copy.deepcopy(full)
    result = truncate_text_encoder(short, READ)
    with torch.inference_mode():
        ids = torch.randint(0, NARROW["vocab_size"], (1, tokens))
        a = full(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        b = short(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        identical = all(torch.equal(a[k], b[k]) for k in READ)
    before, after = _time_encode(full, tokens, repeats), _time_encode(short, tokens, repeats)
    med_before, med_after = statistics.median(before), statistics.median(after)
    return {
        "qwen3_4b_params_before": real_before,
        "qwen3_4b_params_after": real_after,
        "qwen3_4b_bf16_gib_saved": round((real_before - real_after) * 2 / 2**30, 3),
        "qwen3_4b_matmul_gflop_per_token_before": round(flops_before / 1e9, 3),
        "qwen3_4b_matmul_gflop_per_token_after": round(flops_after / 1e9, 3),
        "timed_geometry": NARROW,
        "timed_layers": [result.layers_before, result.layers_after],
        "tokens": tokens,
        "encode_s_before": round(med_before, 4),
        "encode_s_after": round(med_after, 4),
        "speedup": round(med_before / med_after, 3),
        "hidden_states_identical": identical,
    }


def bench_previews(shapes: list[str], repeats: int) -> dict[str, Any]:
    """ms per step of `engine/modes/previews.py` on FLUX.2's 128 packed channels, and on the tiny model's 4."""
    import torch

    from neuron_app.engine.modes.previews import latent_preview
    from neuron_app.shapes import Resolution

    out: dict[str, Any] = {}
    for name in shapes:
        res = Resolution.parse(name)
        for channels in (128, 4):
            packed = torch.randn(1, (res.height // 16) * (res.width // 16), channels)
            latent_preview(packed, res.width, res.height)  # warm
            times = seconds(lambda _, p=packed, r=res: latent_preview(p, r.width, r.height), range(repeats))
            out[f"{name}/{channels}ch"] = {"ms_per_step": round(statistics.median(times) * 1000, 3)}
    return out


def render(report: dict[str, Any], command: str) -> str:
    """The section BENCHMARKS.md shows: the encoder before/after, then ms per preview step by shape."""
    host = f"{os.cpu_count()} logical cores, Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}"
    lines = [f"Command: `{command}` ({host} at the end). Wall times, median of the repeats.", ""]
    enc = report.get("text_encoder")
    if enc:
        geometry = enc["timed_geometry"]
        lines += [
            "**Text encoder stopped at the last layer klein reads** (`text_encoder_out_layers=(9, 18, 27)`: layers "
            "28-35, the final norm and `lm_head` dropped). Parameters and matmul work are exact at Qwen3-4B's real "
            "geometry (built on the meta device); the time is a stand-in with Qwen3-4B's depth and vocabulary at "
            f"{geometry['hidden_size']} wide (this host cannot hold 4B parameters twice), {enc['tokens']} tokens.",
            "",
            "| | before | after | ratio |",
            "|---|---|---|---|",
            f"| Qwen3-4B parameters | {enc['qwen3_4b_params_before'] / 1e9:.2f} B | "
            f"{enc['qwen3_4b_params_after'] / 1e9:.2f} B | "
            f"{enc['qwen3_4b_params_after'] / enc['qwen3_4b_params_before']:.3f} |",
            f"| Qwen3-4B matmul GFLOP per token | {enc['qwen3_4b_matmul_gflop_per_token_before']} | "
            f"{enc['qwen3_4b_matmul_gflop_per_token_after']} | "
            f"{enc['qwen3_4b_matmul_gflop_per_token_after'] / enc['qwen3_4b_matmul_gflop_per_token_before']:.3f} |",
            f"| encode, stand-in ({enc['timed_layers'][0]} -> {enc['timed_layers'][1]} layers) | "
            f"{enc['encode_s_before'] * 1000:.0f} ms | {enc['encode_s_after'] * 1000:.0f} ms | "
            f"{enc['encode_s_after'] / enc['encode_s_before']:.3f} |",
            "",
            f"Weights saved in bf16: {enc['qwen3_4b_bf16_gib_saved']} GiB (on Neuron: that much less HBM). Hidden "
            f"states klein reads identical before and after: {enc['hidden_states_identical']}.",
            "",
        ]
    lines += [
        "**Live step previews** (`engine/modes/previews.py`: FLUX.2's latent-to-RGB projection on the host, no VAE, no "
        "device graph, no compile), ms per denoising step. 128 channels: FLUX.2-klein's packed latents; 4: the tiny "
        "test model's.",
        "",
    ]
    shapes = dict.fromkeys(key.split("/")[0] for key in report["previews"])
    rows = [[s, *(report["previews"][f"{s}/{c}ch"]["ms_per_step"] for c in (128, 4))] for s in shapes]
    return "\n".join([*lines, md.table(["shape", "128 channels (ms/step)", "4 channels (ms/step)"], rows)])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    if not args.skip_encoder:
        report["text_encoder"] = bench_text_encoder(args.tokens, args.repeats)
    shapes = [x for x in args.preview_shapes.split(",") if x]
    report["previews"] = bench_previews(shapes, max(5, args.repeats * 5))
    return report


def main(argv: list[str] | None = None) -> int:
    found = script.parser("studies.klein_modes", __doc__, "also write the section (benchmarks/klein-modes.json)")
    found.add_argument("--tokens", type=int, default=128, help="prompt tokens encoded (klein pads to 512)")
    found.add_argument("--repeats", type=int, default=3)
    found.add_argument("--skip-encoder", action="store_true", help="measure the previews only (seconds)")
    found.add_argument("--preview-shapes", default="1024x1024,1344x768,512x512,64x64")
    return script.main("studies.klein_modes", TITLE, found, measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
