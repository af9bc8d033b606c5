"""Output: the post-processing stage (safety, marks, encode) and the images stored on disk."""
