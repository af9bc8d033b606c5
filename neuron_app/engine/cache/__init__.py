"""The local cache: the manifest of compiled shapes, estimates from its history, encoded prompts."""
