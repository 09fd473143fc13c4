"""Families answer for themselves: the config lists its switches, describes its shape and counts its
FLOPs; the model resamples its own position table; the forward's grid keyword is ``grid_thws``."""

from __future__ import annotations

import warnings

import pytest
import torch

from moonvit import MoonViT, MoonViTConfig, preset_config
from moonvit.model.config import PRESETS
from moonvit.model.position import resample_taps
from moonvit.perf import config_flops, encoder_flops
from moonvit_train.build import describe

# The one-line shapes train.build.describe wrote before the config answered for itself: a run
# resumes only where the checkpoint's string equals the new one, so these may not change.
DESCRIBED = {
    "so400m": "27 blocks x 1152 (16 heads, MLP 4304), patch 14, table 64x64",
    "so400m-3d": "27 blocks x 1152 (16 heads, MLP 4304), patch 14, table 64x64",
    "small": "6 blocks x 384 (6 heads, MLP 1536), patch 14, table 64x64",
    "tiny": "2 blocks x 64 (4 heads, MLP 128), patch 14, table 64x64",
    "small-3d": "6 blocks x 384 (6 heads, MLP 1536), patch 14, table 64x64",
    "tiny-3d": "2 blocks x 64 (4 heads, MLP 128), patch 14, table 64x64",
    "moonvit-v2": "27 blocks x 1024 (12 heads, MLP 4096), patch 14, table 64x64, "
    "attention 1536, rmsnorm, no biases, bilinear",
    "small-v2": "6 blocks x 384 (6 heads, MLP 1536), patch 14, table 64x64, "
    "attention 576, rmsnorm, no biases, bilinear",
    "tiny-v2": "2 blocks x 64 (4 heads, MLP 128), patch 14, table 64x64, attention 96, rmsnorm, no biases, bilinear",
}

K3_SWITCHES = {
    "norm_type": "rmsnorm",
    "layer_norm_eps": None,
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
    "pos_emb_interpolation_mode": "bilinear",
}


def old_flops(seqlens: list[int], config: MoonViTConfig) -> float:
    """moonvit.perf's count as it was written before the config counted its own."""
    d, a, m = config.hidden_size, config.attention_width, config.intermediate_size
    patches = sum(seqlens)
    per_block = 2 * patches * (4 * d * a + 2 * d * m) + sum(4 * n**2 * a for n in seqlens)
    return 2 * patches * 3 * config.patch_size**2 * d + config.num_hidden_layers * per_block


def test_every_preset_is_pinned() -> None:
    assert set(DESCRIBED) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_describe_unchanged(name: str) -> None:
    config = preset_config(name)
    assert config.describe() == DESCRIBED[name]
    assert describe(config) == DESCRIBED[name]


@pytest.mark.parametrize("name", ["so400m", "so400m-3d", "small", "tiny", "small-3d", "tiny-3d"])
def test_default_families_have_no_switches(name: str) -> None:
    # Kimi-VL, K2.5 / K2.6 (a temporal table is a size, not a switch) and LocateAnything (so400m)
    assert preset_config(name).switches() == {}


@pytest.mark.parametrize(("name", "width"), [("moonvit-v2", 1536), ("small-v2", 576), ("tiny-v2", 96)])
def test_k3_lists_its_switches(name: str, width: int) -> None:
    assert preset_config(name).switches() == {"qkv_hidden_size": width, **K3_SWITCHES}


def test_one_switch_is_described() -> None:
    config = preset_config("tiny", linear_bias=False)
    assert config.switches() == {"linear_bias": False}
    assert config.describe().endswith(
        ", attention 64, layernorm, biases only in attention and patch embedding, bicubic"
    )
    # an epsilon alone is listed but is not a shape
    assert preset_config("tiny", layer_norm_eps=1e-6).describe() == DESCRIBED["tiny"]


GRIDS = ([[4, 4]], [[2, 6], [8, 4], [4, 4]], [[1, 10, 12], [1, 2, 2]])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flops_as_before(name: str) -> None:
    config = preset_config(name)
    clip = [[4, 6, 8]] if config.max_frames >= 4 else []
    for grid in (*GRIDS, [[2, 2], *clip]):
        seqlens = [int(torch.tensor(row).prod()) for row in grid]
        expected = old_flops(seqlens, config)
        assert config.flops(seqlens) == expected
        assert config_flops(seqlens, config) == expected
        assert config_flops(seqlens, config, depth=1) < expected
    hidden, mlp, attention = config.hidden_size, config.intermediate_size, config.attention_width
    assert encoder_flops([16, 9], hidden, mlp, config.num_hidden_layers, 14, attention) == old_flops([16, 9], config)


@pytest.mark.parametrize("name", ["tiny", "tiny-3d", "tiny-v2"])
def test_model_flops_of_a_grid(name: str) -> None:
    model = MoonViT.from_preset(name)
    grid = [[1, 4, 6], [model.config.max_frames, 2, 2]]
    assert model.flops(grid) == old_flops([24, 4 * model.config.max_frames], model.config)
    assert model.flops(torch.tensor([[4, 6], [2, 2]])) == old_flops([24, 4], model.config)


@pytest.mark.parametrize("name", ["tiny", "tiny-v2"])
def test_position_table_resamples_by_its_own_mode(name: str) -> None:
    model = MoonViT.from_preset(name)
    rows, cols = 3, 5
    table = model.position_table(rows, cols)
    assert table.shape == (rows, cols, model.config.hidden_size)
    assert table.requires_grad
    # what the forward adds: F.interpolate of the (C, H, W) table, in the family's mode
    stored = model.patch_embed.pos_emb.weight.detach().permute(2, 0, 1).unsqueeze(0)
    mode = model.config.pos_emb_interpolation_mode
    direct = torch.nn.functional.interpolate(stored, size=(rows, cols), mode=mode, align_corners=False)
    torch.testing.assert_close(table.detach(), direct[0].permute(1, 2, 0), rtol=1e-5, atol=1e-6)
    # the config's taps are the resampling's, in its mode
    positions = torch.tensor([[0, 0], [2, 4]])
    heights, widths = torch.tensor([rows, rows]), torch.tensor([cols, cols])
    taps, weights = model.config.position_taps(positions, heights, widths)
    expected = resample_taps(positions, heights, widths, 64, 64, mode)
    assert torch.equal(taps, expected[0]) and torch.equal(weights, expected[1])


def test_grid_thws_keyword() -> None:
    torch.manual_seed(0)
    model = MoonViT.from_preset("tiny").eval()
    grid = [[4, 4], [2, 6]]
    pixels = torch.randn(28, 3, 14, 14)
    with torch.no_grad():
        positional = model(pixels, grid).last_hidden_state
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            keyword = model(pixels, grid_thws=grid).last_hidden_state
        with pytest.warns(DeprecationWarning, match="grid_thws") as caught:
            old = model(pixels, grid_hws=grid).last_hidden_state
    assert caught[0].filename == __file__  # pointed at the caller, not at torch
    assert torch.equal(positional, keyword) and torch.equal(positional, old)
    with pytest.raises(TypeError, match="both"):
        model(pixels, grid_thws=grid, grid_hws=grid)
    with pytest.raises(TypeError, match="unexpected keyword"):
        model(pixels, grid_sizes=grid)
