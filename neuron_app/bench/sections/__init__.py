"""The bench's sections, one module each: `section(harness)` runs it from the orchestrator, `measure(spec)` (where
the section has its own worker kind, named by `KIND`) runs inside a worker, `render(section)` is its Markdown
(the report says instead when the section failed or did not run).

The registry (which sections, in which order) is `neuron_app.bench.harness.REGISTRY`.
"""
