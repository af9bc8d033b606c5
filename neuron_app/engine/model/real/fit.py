"""One row of `python -m neuron_app plan` (plan.py): one model x shape x TP x instance (x references), its memory
per core, its placement and its roofline floor per image, from the fake-tensor measurements (measure.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from neuron_app.engine.model.real import layout
from neuron_app.engine.model.real.catalog import GIB, Instance, load_spec
from neuron_app.shapes import Resolution


def _gib(nbytes: float) -> float:
    return round(nbytes / GIB, 3)


def _seconds(measured: Any, inst: Instance) -> float:
    compute = measured.flops / (inst.bf16_tflops_per_core * 1e12)
    memory = measured.weight_bytes / inst.hbm_bytes_per_s_per_core
    return max(compute, memory)


def plan_one(
    spec: str,
    model: str,
    shape: Resolution,
    tp: int,
    inst: Instance,
    references: int = 0,
    type_name: str | None = None,
    hbm_gib: float | None = None,
    setting: str = "auto",
) -> dict[str, Any]:
    """One model x shape x TP x instance (x references), as the JSON object the command prints."""
    from neuron_app.engine.model.real import measure

    pipeline = load_spec(spec)["pipeline"]
    steps, tokens = pipeline["default_steps"], pipeline["max_sequence_length"]
    w, h = shape.width, shape.height
    measured = {
        "transformer": measure.transformer(spec, w, h, tp, tokens, references),
        "text_encoder": measure.text_encoder(spec, tokens),
        "vae": measure.vae(spec, w, h),
    }
    encode = measure.vae_encode(spec, w, h) if references else None
    if encode is not None and encode.activation_bytes > measured["vae"].activation_bytes:
        measured["vae"] = replace(measured["vae"], activation_bytes=encode.activation_bytes)
    whole_step = measure.transformer(spec, w, h, 1, tokens, references).flops
    placed = layout.place(measured, tp, inst, hbm_gib, setting)
    inst = placed["inst"]
    fullest = placed["fullest"]
    step_s = _seconds(measured["transformer"], inst)
    encodes_s = references * _seconds(encode, inst) if encode else 0.0
    floor = steps * step_s + _seconds(measured["text_encoder"], inst) + _seconds(measured["vae"], inst) + encodes_s
    total = round((fullest["weights"] + fullest["activations"]) / GIB + inst.reserve_gib_per_core, 3)
    encode_flops = references * encode.flops if encode else 0
    image_flops = steps * whole_step + measured["text_encoder"].flops + measured["vae"].flops + encode_flops
    return {
        "model": model,
        "spec": spec,
        "shape": str(shape),
        "references": references,
        "tp": tp,
        "instance": inst.name,
        "lnc": inst.lnc,
        "dtype": "bfloat16",
        "steps": steps,
        "text_tokens": tokens,
        "joint_tokens": (w // 16) * (h // 16) * (1 + references) + tokens,
        "components": {
            name: {
                "params": m.params,
                "weights_gib_per_core": _gib(m.weight_bytes),
                "activations_gib": _gib(m.activation_bytes),
                "tflop_per_call_per_core": round(m.flops / 1e12, 3),
            }
            for name, m in measured.items()
        },
        "activations_gib_per_core": _gib(fullest["activations"]),
        "runtime_reserve_gib_per_core": round(inst.reserve_gib_per_core, 3),
        "total_gib_per_core": total,
        "hbm_gib_per_core": inst.hbm_gib_per_core,
        "cores_per_bank": inst.cores_per_bank,
        "fits": placed["fits"],
        "placement": placed["placement"],
        "core_loads_gib": [round(g, 3) for g in placed["loads_gib"]],
        "instance_view": layout.instance_view(placed["loads_gib"], inst, floor, type_name, tp),
        "tflop_per_step": round(whole_step / 1e12, 3),
        "tflop_per_image": round(image_flops / 1e12, 3),
        "floor_s_per_step": round(step_s, 4),
        "floor_s_per_image": round(floor, 3),
        "peak_bf16_tflops_per_core": inst.bf16_tflops_per_core,
        "hbm_gb_per_s_per_core": round(inst.hbm_bytes_per_s_per_core / 1e9, 1),
    }
