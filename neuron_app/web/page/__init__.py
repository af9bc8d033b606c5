"""The Gradio page and its named API endpoints (the MCP tools' source)."""
