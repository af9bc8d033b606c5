# The diffusers guide "AWS Trainium", tensor parallelism, as written there: its set-up lines (process group, mesh,
# device, TensorParallelConfig), the parallel_config passed to the transformer's from_pretrained() and
# `pipe.to(device)` after loading (as a user writes it: the sharded transformer's DTensor parameters included), with
# a CPU generator so every rank draws the same latents (diffusers' tensor-parallel guide does the same). Only the
# model path and the size are read from the environment (GUIDE_MODEL: a local folder for the Hub id; GUIDE_SIZE).
# On a trn instance: torchrun --nproc_per_node=8 examples/guide_tp.py; anywhere else:
# torchrun --nproc_per_node=2 -m neuron_app emulate examples/guide_tp.py
import os

import torch
import torch.distributed as dist
from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel, TensorParallelConfig
from torch.distributed.device_mesh import DeviceMesh

MODEL = os.environ.get("GUIDE_MODEL", "black-forest-labs/FLUX.2-klein-4B")
SIZE = int(os.environ.get("GUIDE_SIZE", "1024"))

dist.init_process_group(backend="neuron")
mesh = DeviceMesh("neuron", list(range(dist.get_world_size())))
device = torch.neuron.current_device()
parallel_config = TensorParallelConfig(mesh=mesh)

transformer = Flux2Transformer2DModel.from_pretrained(
    MODEL, subfolder="transformer", dtype=torch.bfloat16, parallel_config=parallel_config
)
pipe = Flux2KleinPipeline.from_pretrained(MODEL, transformer=transformer, dtype=torch.bfloat16)
pipe.to(device)

image = pipe(
    prompt="a golden retriever surfing a wave, photorealistic",
    height=SIZE,
    width=SIZE,
    num_inference_steps=4,
    generator=torch.Generator("cpu").manual_seed(0),
).images[0]
if dist.get_rank() == 0:
    image.save(os.environ.get("GUIDE_OUTPUT", "output.png"))
