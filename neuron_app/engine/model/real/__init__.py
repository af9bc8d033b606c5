"""The real FLUX.2-klein architectures as configs only (specs/), measured on fake tensors for `plan`.

Nothing here holds a weight: the modules are the real diffusers/transformers classes built under torch's
FakeTensorMode, so a 9-billion-parameter model costs no memory and its forward no compute (docs/real-size.md).
"""
