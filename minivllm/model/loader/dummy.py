"""Random weights in a model's shapes, nothing read (vLLM's ``load_format="dummy"``).

For measuring shapes whose weights are not at hand: an 8B model's decode rate on a GPU
needs its 16 GB of weights on the card, not on a disk that has to be written first. The
values are uniform in [-1e-3, 1e-3] as vLLM draws them: small enough that no activation
overflows in bf16, so every kernel runs as it would on real weights. The outputs mean
nothing.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every floating-point parameter in place, from a generator on its device (the
    same seed gives the same weights on the same device)."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if not param.is_floating_point():
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.uniform_(-1e-3, 1e-3, generator=gen)
