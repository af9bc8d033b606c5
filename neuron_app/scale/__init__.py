"""How the engine spreads over cores and machines: torchrun lockstep (tensor parallel)."""
