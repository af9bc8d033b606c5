"""FAKE torch_neuronx._C: TorchNeuron's private compile-cache counters, moved by tests."""

STATS = {"persistent_hits": 0, "persistent_misses": 0, "total_compilations": 0}


def _neuron_set_metrics_enabled(enabled):
    STATS["metrics_enabled"] = bool(enabled)


def _get_compilation_cache_stats():
    return dict(STATS)
