"""The layers every model is built from, each owning its weights and their sharding."""
