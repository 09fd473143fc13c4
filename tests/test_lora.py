"""LoRA on the tower's linears (moonvit.model.lora): a wrapped tower starts as the base, trains only its
adapters, merges back into a plain checkpoint, and its adapter saves and loads alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import random_pack, tiny_model

from moonvit import MoonViT
from moonvit.model import linear as cpu_linear
from moonvit.model.lora import (
    LoRAConfig,
    LoRALinear,
    apply_lora,
    load_adapter,
    lora_config,
    lora_state_dict,
    merge_lora,
    save_adapter,
)

GRIDS = [(4, 6), (2, 2), (6, 4)]


def randomize_adapters_(model: nn.Module, seed: int = 1) -> None:
    """B away from zero, as after training."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.copy_(torch.randn(module.lora_b.shape, generator=gen) * 0.1)


def test_a_wrapped_tower_starts_bit_identical_and_only_its_adapters_train():
    model = tiny_model()
    pixels, grids = random_pack(GRIDS)
    with torch.no_grad():
        before = model(pixels, grids).last_hidden_state
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrapped = apply_lora(model, LoRAConfig(rank=4, alpha=8))
    assert wrapped == [f"encoder.blocks.{i}.{name}" for i in range(2) for name in ("wqkv", "wo", "mlp.fc0", "mlp.fc1")]
    with torch.no_grad():
        assert torch.equal(model(pixels, grids).last_hidden_state, before)  # B = 0: the base's bits

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{name}.{ab}" for name in wrapped for ab in ("lora_a", "lora_b")}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(2):
        model(pixels, grids).last_hidden_state.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], tensor) for name, tensor in base.items())  # names kept, values frozen
    assert all(after[f"{name}.lora_b"].abs().max() > 0 for name in wrapped)


def test_merged_tower_computes_the_same_and_saves_as_a_plain_checkpoint(tmp_path):
    model = tiny_model()
    apply_lora(model, LoRAConfig(rank=2, alpha=6, targets=("wqkv", "fc1")))
    randomize_adapters_(model)
    pixels, grids = random_pack(GRIDS)
    with torch.no_grad():
        unmerged = model(pixels, grids).last_hidden_state
        plain = tiny_model()(pixels, grids).last_hidden_state
        merged = merge_lora(model)
        assert merged is model and not any(isinstance(m, LoRALinear) for m in model.modules())
        out = model(pixels, grids).last_hidden_state
    assert (unmerged - plain).abs().max() > 1e-2  # the adapters do change the output
    torch.testing.assert_close(out, unmerged, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == set(tiny_model().state_dict())

    assert isinstance(model, MoonViT)
    model.save_pretrained(tmp_path / "merged")
    loaded = MoonViT.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert torch.equal(loaded(pixels, grids).last_hidden_state, out)


def test_a_lora_layer_takes_the_plain_path_in_bf16_cpu_inference():
    """The fused CPU linear reads weight and bias alone: a LoRA layer must run its own forward."""
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(48, 40), rank=4, alpha=4).bfloat16()
    with torch.no_grad():
        layer.lora_b.normal_()
    x = torch.randn(5, 48).bfloat16()
    with torch.no_grad():
        assert torch.equal(cpu_linear.linear(layer, x), layer(x))
        base = nn.Linear(48, 40).bfloat16()
        base.load_state_dict({"weight": layer.weight, "bias": layer.bias})
        assert not torch.equal(cpu_linear.linear(base, x), layer(x))


def test_the_adapter_saves_and_loads_alone(tmp_path):
    model = tiny_model()
    apply_lora(model, LoRAConfig(rank=3, alpha=3, dropout=0.1, targets=("wo", "mlp.fc0")))
    randomize_adapters_(model)
    files = save_adapter(model, tmp_path / "adapter", base="tiny")
    assert files == ["adapter.safetensors", "adapter_config.json"]
    fresh = tiny_model()
    assert load_adapter(fresh, tmp_path / "adapter") == [
        f"encoder.blocks.{i}.{name}" for i in range(2) for name in ("wo", "mlp.fc0")
    ]
    assert lora_config(fresh) == LoRAConfig(3, 3.0, 0.1, ("wo", "fc0"))
    pixels, grids = random_pack(GRIDS)
    with torch.no_grad():  # eval mode: no dropout
        assert torch.equal(fresh(pixels, grids).last_hidden_state, model(pixels, grids).last_hidden_state)
    assert all(torch.equal(lora_state_dict(fresh)[k], v) for k, v in lora_state_dict(model).items())


def test_bad_targets_and_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"fc2 name no linear of the model .*'fc0', 'fc1', 'wo', 'wqkv'"):
        apply_lora(tiny_model(), LoRAConfig(rank=2, targets=("wqkv", "fc2")))
    model = tiny_model()
    apply_lora(model, LoRAConfig(rank=2))
    with pytest.raises(ValueError, match="already holds LoRA adapters"):
        apply_lora(model, LoRAConfig(rank=2))
    with pytest.raises(ValueError, match="rank must be at least 1"):
        LoRAConfig(rank=0)
    assert LoRAConfig(rank=8).scale == 1.0 and LoRAConfig(rank=8, alpha=16).scale == 2.0
