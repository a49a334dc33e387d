"""The layers every model is built from (one Attention for all), owning weights and sharding."""
