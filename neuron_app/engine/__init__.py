"""What makes an image: the pipeline manager and what it stands on (loading, compiling, caching).

Imports flow one way: the engine never imports from `web` or `scale`.
"""
