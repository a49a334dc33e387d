"""A worker: one device's model and KV cache, and the model runner that feeds them each step."""
