"""How people reach the engine: the Gradio page and API, operations endpoints, metrics, the server."""
