"""Standalone measurements (`python -m neuron_app.bench.studies.X`) that `render` puts into BENCHMARKS.md."""
