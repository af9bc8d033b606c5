"""The bench's sections, one module each; what a module has, and their order: `neuron_app.bench.harness.REGISTRY`."""
