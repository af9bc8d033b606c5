"""How the transformer and the VAE are compiled, and what is compiled at start."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class CompileSettings(BaseModel):
    """torch.compile's mode and backend, the VAE's tiles, warm-up at start."""

    compile_mode: Literal["auto", "eager", "full", "regional"] = Field(
        "auto",
        description="eager: no torch.compile; full: the whole transformer, fullgraph, static shapes; "
        "regional: compile_repeated_blocks (one graph per block class, shorter compile); auto: regional on "
        "neuron (no one has compiled the whole 4B transformer as one neuronx-cc job yet), full elsewhere.",
    )

    compile_backend: str | None = Field(
        None,
        description="torch.compile backend; default neuron on neuron, inductor on cuda/cpu. "
        "aot_eager compiles in seconds and is used by the tests.",
    )

    vae_compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Decode in fixed-size compiled VAE tiles (one VAE graph for every shape; shapes with the "
        "same token count then share everything): auto = on for neuron, off elsewhere.",
    )

    vae_tile: int = Field(
        32,
        ge=8,
        le=256,
        description="VAE tile side in latent pixels (x8 image pixels: 256 px); one compiled graph. Small on purpose: "
        "a whole 1024 px decode was measured past neuronx-cc's instruction limit, a 512 px tile reported not to "
        "compile in 30 min (docs/compiling-less.md).",
    )

    vae_tile_overlap: int = Field(
        8, ge=0, le=128, description="Latent pixels shared by neighbouring VAE tiles, blended across (<= tile/2)."
    )

    load_on_start: bool = Field(False, description="Load the pipeline at start instead of on the first request.")

    warmup: Literal["none", "default", "precompiled", "all"] = Field(
        "none",
        description="Compile shapes in the background at start: none, the default shape (so /readyz turns 200 "
        "with no request), those in the manifest, or all.",
    )

    only_precompiled: bool = Field(
        False, description="Offer only shapes that are precompiled or compiled in this process."
    )

    edit_compile_on_demand: bool | None = Field(
        None,
        description="Compile an edit graph (an output shape with its references' buckets) on the first edit that "
        "needs it. Unset = yes on loopback, no where others can reach the server: an edit whose graph is neither "
        "compiled nor precompiled is then refused in one line naming those that are, so no caller picks a cold "
        "compile (docs/compiling-less.md).",
    )
