"""Benchmark harness: compile cost, cache wins, recompile discipline, serving overhead, measured side by side.

`python -m neuron_app.bench --help`. Every measurement that depends on process state (dynamo's compiled graphs, the
compilers' disk caches, peak memory) runs in its own subprocess (`python -m neuron_app.bench _worker ...`), so modes
never share a warm process. Ratios come from one run, so a machine that is busy for the whole run still compares like
with like.
"""
