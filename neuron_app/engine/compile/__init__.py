"""Compiling: the compile modes and counting backend, one graph's compile and warm-up."""
