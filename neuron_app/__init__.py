"""Serve FLUX.2-klein on AWS Trainium (or CPU/CUDA) through a Gradio app.

Importing the package is cheap on purpose: torch, diffusers and gradio are imported only
by the modules that need them, when they are first used.
"""

__version__ = "0.1.0"
