"""Scheduling and KV cache bookkeeping: who runs each step, which blocks they hold (no torch)."""
