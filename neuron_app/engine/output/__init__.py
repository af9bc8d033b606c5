"""Output: what the host does with an image after the device (safety, marks, encode) and the images on disk."""
