"""Speculative decoding: proposals of the next tokens that one forward pass then checks."""
