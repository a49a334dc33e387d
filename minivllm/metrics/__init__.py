"""Serving statistics: per-request timing, the periodic log line, Prometheus metrics."""
