"""Training tiny-shapes on the CPU: the VAE's starting point, the data, the stages (python -m neuron_app train-tiny)."""
