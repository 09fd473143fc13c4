"""Forward hooks on a block's linears see what the module returned: a feature capture that stores wqkv's
output as it is (no clone) keeps wqkv's output, not q and k rotated afterwards in the same buffer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import random_pack, tiny_model
from torch.nn.modules.module import register_module_forward_hook


@contextmanager
def captured(layer: nn.Module, scope: str) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """(input, output) of each call of ``layer``, stored as the hook received them, by a hook on ``layer``
    itself (``scope="module"``) or a global one that picks ``layer`` out of every module's calls."""
    store: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if module is layer:
            store.append((args[0], output))

    handle = layer.register_forward_hook(hook) if scope == "module" else register_module_forward_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("scope", ["module", "global"])
def test_a_hook_on_wqkv_keeps_wqkv_s_output_and_the_encoder_s_bits(scope, dtype):
    """The stored output is the linear of the stored input (the same F.linear call: equal bits) in every
    block; the encoder's output is the same with the hook as without it. Without autograd, where q
    and k are otherwise rotated in wqkv's output buffer."""
    model = tiny_model(seed=4, dtype=dtype)
    pixels, grid_hws = random_pack([(6, 8), (4, 4)], seed=3, dtype=dtype)
    with torch.no_grad():
        plain = model(pixels, grid_hws).last_hidden_state
        for block in model.encoder.blocks:
            with captured(block.wqkv, scope) as store:
                hooked = model(pixels, grid_hws).last_hidden_state
            ((x, output),) = store
            assert torch.equal(output, F.linear(x, block.wqkv.weight, block.wqkv.bias))
            if dtype == torch.float32:
                # bf16: without a hook wqkv may run oneDNN's fused linear, other bits than the module's
                assert torch.equal(hooked, plain)
