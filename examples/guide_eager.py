# The diffusers guide "AWS Trainium", eager mode, as written there; only the model path and the size are read
# from the environment (GUIDE_MODEL: a local folder for the Hub id; GUIDE_SIZE). On a trn instance it runs as is;
# anywhere else: python -m neuron_app emulate examples/guide_eager.py
import os

import torch
from diffusers import Flux2KleinPipeline

MODEL = os.environ.get("GUIDE_MODEL", "black-forest-labs/FLUX.2-klein-4B")
SIZE = int(os.environ.get("GUIDE_SIZE", "1024"))

pipe = Flux2KleinPipeline.from_pretrained(MODEL, dtype=torch.bfloat16)
pipe.to("neuron")
image = pipe(
    prompt="a golden retriever surfing a wave, photorealistic",
    height=SIZE,
    width=SIZE,
    num_inference_steps=4,
).images[0]
image.save(os.environ.get("GUIDE_OUTPUT", "output.png"))
