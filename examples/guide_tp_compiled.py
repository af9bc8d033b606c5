# The diffusers guide "AWS Trainium": its tensor-parallel set-up (examples/guide_tp.py) with its compiled mode's line
# on the sharded transformer, `pipe.transformer.compile(backend="neuron", fullgraph=True, dynamic=False)`: the path
# the app serves TP with, and what the selftest's TP check runs. A warm-up call compiles, the second call is the
# image. On a trn instance: torchrun --nproc_per_node=2 examples/guide_tp_compiled.py; anywhere else:
# torchrun --nproc_per_node=2 -m neuron_app emulate examples/guide_tp_compiled.py (GUIDE_MODEL, GUIDE_SIZE as there)
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
pipe.transformer.compile(backend="neuron", fullgraph=True, dynamic=False)

# Warmup — triggers static graph compilation (on every rank: each compiles its own shard's graph).
pipe(prompt="warmup", height=SIZE, width=SIZE, num_inference_steps=4, generator=torch.Generator("cpu").manual_seed(1))

image = pipe(
    prompt="a golden retriever surfing a wave, photorealistic",
    height=SIZE,
    width=SIZE,
    num_inference_steps=4,
    generator=torch.Generator("cpu").manual_seed(0),
).images[0]
print(f"rank {dist.get_rank()}: compiled sharded transformer on neuron:{device}, image made", flush=True)
if dist.get_rank() == 0:
    image.save(os.environ.get("GUIDE_OUTPUT", "output.png"))
