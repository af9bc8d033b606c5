"""Bench sections on serving: the server's overhead, concurrency, start, restart, replicas, memory, post."""
