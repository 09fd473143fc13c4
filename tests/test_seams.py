"""The extension points: time axis in the grid, kept patches, per-image stochastic depth,
selected hidden states, the attention registry and the per-model grid cache."""

import dataclasses

import pytest
import torch
from helpers import random_pack, tiny_model

import moonvit.model.attention as attention
from moonvit import MoonViT, build_packed_grid, pool_features, preset_config, tokens_per_image
from moonvit.model.blocks import drop_path_per_item

CONFIG = preset_config("tiny")
CONFIG_3D = preset_config("tiny", init_pos_emb_time=4)


# ---- the time axis -----------------------------------------------------------------------------


def test_images_as_n_by_2_and_as_t_equals_1_rows_give_the_same_grid():
    a = build_packed_grid([[2, 4], [6, 6]], CONFIG)
    b = build_packed_grid([[1, 2, 4], [1, 6, 6]], CONFIG)
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), field.name
    assert a.time_index is None and a.pool_index is None and a.merge_index is not None


def test_a_clip_repeats_its_frame_raster_and_numbers_its_frames():
    grid = build_packed_grid([[3, 2, 4], [1, 2, 2]], CONFIG_3D)
    assert grid.seqlens == (24, 4) and grid.cu_seqlens.tolist() == [0, 24, 28]
    frame = [(r, c) for r in range(2) for c in range(4)]
    assert [tuple(p) for p in grid.positions[:24].tolist()] == frame * 3
    # frame f of a clip with t > 1 reads time row f + 1; the image (t = 1) reads none (0)
    assert grid.time_index.tolist() == [1] * 8 + [2] * 8 + [3] * 8 + [0] * 4
    # one resampled table per distinct (h, w), each frame reading the same rows
    assert grid.pos_emb_sizes == ((2, 2), (2, 4))
    assert grid.pos_emb_row.tolist() == [4 + i for i in range(8)] * 3 + [0, 1, 2, 3]
    assert torch.equal(grid.rope_rotation[:8], grid.rope_rotation[8:16])


def test_clip_frames_share_merge_slots_and_average():
    grid = build_packed_grid([[2, 2, 4], [1, 2, 2]], CONFIG_3D)
    assert grid.merge_index is None and grid.num_slots == 8 + 4
    assert grid.pool_index[:8].tolist() == grid.pool_index[8:16].tolist()
    assert grid.pool_weight.tolist() == [0.5] * 16 + [1.0] * 4
    assert tokens_per_image(grid.grid_thws) == [2, 1]


def test_bad_frame_counts_are_named():
    with pytest.raises(ValueError, match="clip 1: grid 0x2x2 has 0 frames"):
        build_packed_grid([[1, 2, 2], [0, 2, 2]], CONFIG_3D)
    with pytest.raises(ValueError, match="clip 0: grid 5x2x2 has 5 frames, over the 4 this encoder takes"):
        build_packed_grid([[5, 2, 2]], CONFIG_3D)


def test_an_encoder_without_a_time_table_refuses_clips():
    model = tiny_model()
    pixels, _ = random_pack([(4, 4)])
    with pytest.raises(ValueError, match="has no temporal embedding"):
        model(pixels, [[2, 2, 4]])
    clip_grid = MoonViT(CONFIG_3D).prepare_grid([[2, 2, 4]])
    with pytest.raises(ValueError, match="over the 1 this encoder takes"):
        model(pixels, grid=clip_grid)


# ---- kept patches (token dropping, MAE) -------------------------------------------------------


def test_kept_rows_carry_the_positions_of_their_place_in_the_full_grid():
    full = build_packed_grid([[4, 6], [2, 2]], CONFIG)
    keep = [torch.tensor([0, 5, 7, 23]), torch.tensor([1, 2])]
    kept = build_packed_grid([[4, 6], [2, 2]], CONFIG, keep=keep)
    rows = torch.tensor([0, 5, 7, 23, 24 + 1, 24 + 2])
    assert torch.equal(kept.positions, full.positions[rows])
    assert torch.equal(kept.rope_rotation, full.rope_rotation[rows])
    assert kept.seqlens == (4, 2) and kept.dropped and kept.merge_index is None
    assert kept.item_index.tolist() == [0, 0, 0, 0, 1, 1]


def test_keeping_every_patch_equals_the_full_forward():
    model = tiny_model()
    pixels, grids = random_pack([(4, 6), (2, 2)])
    full = model(pixels, grids).last_hidden_state
    keep = [torch.arange(24), torch.arange(4)]
    out = model(pixels, grid=model.prepare_grid(grids, keep=keep))
    torch.testing.assert_close(out.last_hidden_state, full, rtol=1e-6, atol=1e-6)
    assert out.merged is None


def test_dropped_patches_are_invisible_to_the_kept_ones():
    """Feeding only the kept patches equals a forward in which the others never existed:
    an image alone and inside a pack agree, and the kept rows do not depend on the dropped pixels."""
    model = tiny_model(dtype=torch.float64)
    pixels, grids = random_pack([(4, 6), (6, 4)], dtype=torch.float64)
    keep = [torch.tensor([1, 4, 9, 10, 22]), torch.tensor([0, 3, 8, 15, 16, 17, 23])]
    rows = torch.cat([keep[0], 24 + keep[1]])
    packed = model(pixels[rows], grid=model.prepare_grid(grids, keep=keep)).last_hidden_state
    alone = model(pixels[keep[0]], grid=model.prepare_grid(grids[:1], keep=keep[:1])).last_hidden_state
    torch.testing.assert_close(packed[:5], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "keep, message",
    [
        ([torch.tensor([0, 1])], "for a pack of 2 items"),
        ([torch.tensor([0, 99]), torch.tensor([0])], "outside item 0"),
        ([torch.tensor([3, 1]), torch.tensor([0])], "strictly increasing"),
        ([torch.tensor([], dtype=torch.int64), torch.tensor([0])], "keeps no patch"),
        ([torch.tensor([0.0]), torch.tensor([0])], "integer"),
    ],
)
def test_bad_keep_is_named(keep, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_packed_grid([[4, 6], [2, 2]], CONFIG, keep=keep)


def test_pixel_count_must_match_the_kept_count():
    model = tiny_model()
    grid = model.prepare_grid([[2, 2]], keep=[torch.tensor([0, 2])])
    with pytest.raises(ValueError, match="the grid keeps 2"):
        model(torch.rand(4, 3, 14, 14), grid=grid)


# ---- stochastic depth per image -----------------------------------------------------------------


def test_drop_path_draws_once_per_image():
    grid = build_packed_grid([[2, 2]] * 64, CONFIG)
    branch = torch.ones(grid.num_patches, 8)
    out = drop_path_per_item(branch, grid, 0.5)
    per_image = out.view(64, 4 * 8)
    assert set(per_image.unique().tolist()) <= {0.0, 2.0}
    assert bool((per_image == per_image[:, :1]).all())  # all of an image's rows alike
    assert 10 < int((per_image[:, 0] == 0).sum()) < 54  # and images differ


def test_drop_path_only_acts_in_training_and_grows_with_depth():
    model = MoonViT(preset_config("tiny", num_hidden_layers=3, drop_path_rate=0.3))
    assert [b.drop_path for b in model.encoder.blocks] == pytest.approx([0.0, 0.15, 0.3])
    pixels, grids = random_pack([(2, 2)] * 8)
    model.eval()
    torch.testing.assert_close(model(pixels, grids).last_hidden_state, model(pixels, grids).last_hidden_state)
    model.train()
    torch.manual_seed(0)
    a = model(pixels, grids).last_hidden_state
    torch.manual_seed(1)
    b = model(pixels, grids).last_hidden_state
    assert not torch.allclose(a, b)


# ---- selected hidden states -------------------------------------------------------------------


def test_selected_hidden_states_equal_the_full_list():
    model = tiny_model(num_hidden_layers=4)
    pixels, grids = random_pack([(2, 4), (4, 4)])
    every = model(pixels, grids, output_hidden_states=True).hidden_states
    chosen = model(pixels, grids, hidden_state_indices=(-4, -3, -2, -1)).hidden_states
    assert len(chosen) == 4
    for a, b in zip(chosen, every[-4:]):
        assert torch.equal(a, b)
    assert torch.equal(model(pixels, grids, hidden_state_indices=[0]).hidden_states[0], every[0])
    with pytest.raises(ValueError, match="out of range for 5 hidden states"):
        model(pixels, grids, hidden_state_indices=[5])


# ---- the attention registry -------------------------------------------------------------------


def test_a_registered_backend_is_accepted_everywhere(monkeypatch):
    calls = []

    def logged(q, k, v, grid):
        calls.append(q.shape[0])
        return attention.eager_attention(q, k, v, grid)

    monkeypatch.setattr(attention, "_BACKENDS", dict(attention._BACKENDS))
    attention.register_attention("logged", logged)
    assert "logged" in attention.attention_names()
    model = tiny_model(attn_implementation="logged")
    pixels, grids = random_pack([(2, 2), (4, 6)])
    out = model(pixels, grids).last_hidden_state
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(out, model(pixels, grids).last_hidden_state, rtol=1e-5, atol=1e-5)
    assert calls == [28] * model.config.num_hidden_layers
    with pytest.raises(ValueError, match="'auto' is reserved"):
        attention.register_attention("auto", logged)


def test_unknown_backends_are_refused_with_the_registered_names():
    names = r"\('auto', 'flash_attention_2', 'varlen', 'openvino', 'sdpa', 'flex', 'eager'\)"
    with pytest.raises(ValueError, match=f"one of {names}"):
        preset_config("tiny", attn_implementation="xformers")


# ---- caches are per model -----------------------------------------------------------------------


def test_clearing_one_models_caches_leaves_another_models():
    a, b = tiny_model(), tiny_model(seed=1)
    grid_a, grid_b = a.prepare_grid([[2, 2]]), b.prepare_grid([[2, 2]])
    a.clear_caches()
    assert b.prepare_grid([[2, 2]]) is grid_b
    assert a.prepare_grid([[2, 2]]) is not grid_a


def test_copies_start_with_an_empty_grid_cache():
    import copy

    model = tiny_model()
    model.prepare_grid([[2, 2]])
    clone = copy.deepcopy(model)
    assert len(clone.grid_cache) == 0 and len(model.grid_cache) == 1


# ---- pooling ------------------------------------------------------------------------------------


def test_pool_features_are_per_image_means():
    model = tiny_model()
    pixels, grids = random_pack([(2, 4), (4, 4)])
    out = model(pixels, grids)
    grid = model.prepare_grid(grids)
    pooled = pool_features(out, grid)
    torch.testing.assert_close(pooled[1], out.last_hidden_state[8:].mean(0))
    merged = pool_features(out, grids, "merged")
    assert merged.shape == (2, 4 * 64)
    torch.testing.assert_close(merged[0], out.merged[:2].flatten(1).mean(0))
