"""Bench sections on compiling: modes, recompiles, graph families, edits, LoRA."""
