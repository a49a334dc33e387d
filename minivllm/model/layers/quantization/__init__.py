"""Quantized weights: how a layer keeps and multiplies weights that are not plain floats."""
