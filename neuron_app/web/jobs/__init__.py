"""Asynchronous jobs of the OpenAI API: workers, their SQLite store, webhooks, the usage book."""
