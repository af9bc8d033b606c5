"""The door every request meets before Gradio or the OpenAI API: middleware.py, with its aliases and MCP checks."""
