"""Executors: start the workers (this process, worker processes, Ray actors) and call them."""
