"""Tensor and pipeline parallelism's plumbing: the process groups a worker joins."""
