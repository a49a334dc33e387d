"""Tensor parallelism's plumbing: the process group a worker shares with its peers."""
