"""An exponential moving average of the trained weights (``--ema DECAY``).

After every optimizer step each trained parameter's average moves toward it:
``ema = decay_n * ema + (1 - decay_n) * param``, with ``decay_n = min(decay, (1 + n) / (10 + n))`` at
the n-th update (TensorFlow's ``ExponentialMovingAverage`` with ``num_updates``), so a short run's
average is not stuck near the initial weights. Frozen weights are their own average and are not
copied.

The averages are tensors of the parameters' own kind: plain tensors, or under FSDP2 the same
shards (DTensors) as the parameters, so an update is local to each rank. To gather or restore them
the engine swaps them into the parameters (:meth:`WeightEMA.swapped`) and uses the model's own
full state dict, which already gathers and shards for any world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

__all__ = ["WeightEMA"]


class WeightEMA:
    """The moving average of ``module``'s trained parameters (those with ``requires_grad``)."""

    def __init__(self, module: nn.Module, decay: float) -> None:
        self.decay = decay
        self.updates = 0
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.averages = [p.detach().clone() for p in self.params]

    def current_decay(self) -> float:
        """The decay of the next update (see the module docstring)."""
        n = self.updates + 1
        return min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self) -> None:
        """Move every average toward its parameter (after an optimizer step)."""
        weight = 1.0 - self.current_decay()
        for average, param in zip(self.averages, self.params):
            average.lerp_(param.detach(), weight)
        self.updates += 1

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Within it the parameters hold the averages, and the averages the parameters' values; both
        are swapped back after it (on an exception too). What the block writes into the parameters
        becomes the averages (how a saved state restores them)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for average, param in zip(self.averages, self.params):
            kept = param.detach().clone()
            param.copy_(average)
            average.copy_(kept)
