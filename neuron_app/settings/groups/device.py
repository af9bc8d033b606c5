"""Where it runs: the device (Neuron, emulated, CUDA, CPU), the emulator's rules, cores, tensor parallel."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, WrapValidator, field_validator

from neuron_app.settings.groups.replicas import auto_count


class DeviceSettings(BaseModel):
    """The device, where the VAE decodes, the NeuronCores this process takes, the TP degree."""

    device: Literal["auto", "neuron", "neuron-emulated", "cuda", "cpu"] = Field(
        "auto",
        description="Where to run; auto picks neuron, then cuda, then cpu. neuron-emulated runs the neuron code "
        "path on CPU under TorchNeuron's rules (tests, CI, the selftest without Trainium).",
    )

    neuron_rules: Literal["enforce", "record"] = Field(
        "enforce",
        description="neuron-emulated: a request that breaks a TorchNeuron rule fails (enforce) or is only "
        "counted in status (record).",
    )

    vae_device: Literal["device", "cpu"] = Field(
        "device",
        description="Where the VAE decodes: on the device (tiled when vae_compile is on), or on the host CPU in "
        "float32 (no VAE graph to compile; what a public klein-4B Trainium port does).",
    )

    placement: Literal["auto", "together", "text-encoder-apart", "text-encoder-and-vae-apart"] = Field(
        "auto",
        description="Which NeuronCore holds which component: together (one core), text-encoder-apart (the text "
        "encoder on a second core), text-encoder-and-vae-apart (a third for the VAE); auto: the first that `plan` "
        "finds fitting the served model in this device's memory, else together. Each component on its own device "
        "index (neuron:0, neuron:1, ...; cuda:N); CPU ignores it. With TP > 1 only together is served.",
    )

    tp_degree: Annotated[int, WrapValidator(auto_count)] = Field(
        1,
        ge=1,
        validate_default=True,
        description='Tensor-parallel degree (NeuronCores per model copy, one process each); "auto": the '
        "topology's (python -m neuron_app plan --best). With replicas > 1 each replica is one TP group on its own "
        "aligned block of cores.",
    )

    visible_cores: str | None = Field(
        None,
        description="NeuronCores this process reserves: N, N-M or a list covering one contiguous range (3-5,6), "
        "exported as NEURON_RT_VISIBLE_CORES; unset = every core it can see. Not under torchrun, which gives "
        "each rank one core.",
    )

    @field_validator("visible_cores")
    @classmethod
    def _check_visible_cores(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from neuron_app.environment import parse_cores

        first, last = parse_cores(value)  # the runtime's list forms too; written back as one range
        return str(first) if first == last else f"{first}-{last}"
