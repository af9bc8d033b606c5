"""The model: where it comes from and how it loads, its parts (text encoder cut, tiled VAE), one pipeline call."""
