"""What Gradio's MCP server offers beyond the page's endpoints: answers mended, cancel_job."""
