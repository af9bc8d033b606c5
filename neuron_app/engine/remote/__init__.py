"""The shared compile cache through S3: push, verified pull, the index, the store."""
