"""The OpenAI-compatible Images API: routes, forms, errors, sizes, image URLs."""
