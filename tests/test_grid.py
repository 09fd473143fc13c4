import pytest
import torch

from moonvit import MoonViT, build_packed_grid, preset_config

CONFIG = preset_config("tiny")


def test_sequence_metadata():
    grid = build_packed_grid(torch.tensor([[2, 4], [6, 6], [2, 4]]), CONFIG)
    assert grid.seqlens == (8, 36, 8)
    assert grid.cu_seqlens.dtype == torch.int32
    assert grid.cu_seqlens.tolist() == [0, 8, 44, 52]
    assert grid.max_seqlen == 36 and grid.num_patches == 52 and grid.num_images == 3
    assert [g.seqlen for g in grid.attention_groups] == [8, 36]
    # Images 0 and 2 share a length but are not adjacent: gathered. Image 1 is one slice.
    assert grid.attention_groups[0].token_index.tolist() == [list(range(0, 8)), list(range(44, 52))]
    assert grid.attention_groups[0].start is None
    assert (grid.attention_groups[1].start, grid.attention_groups[1].token_index) == (8, None)


def test_positions_are_raster_within_each_image():
    grid = build_packed_grid([[2, 4], [4, 2]], CONFIG)
    expected = [(r, c) for r in range(2) for c in range(4)] + [(r, c) for r in range(4) for c in range(2)]
    assert [tuple(p) for p in grid.positions.tolist()] == expected


def test_merge_index_groups_2x2_in_row_major_order():
    grid = build_packed_grid([[2, 2], [4, 6]], CONFIG)
    first = grid.merge_index[:4].tolist()
    assert first == [0, 1, 2, 3]
    second = (grid.merge_index[4:] - 4).view(-1, 4)
    # Image 2 is 4 x 6: merged grid 2 x 3, raster; inside a group (0,0),(0,1),(1,0),(1,1).
    expected = []
    for mr in range(2):
        for mc in range(3):
            expected.append([(2 * mr + a) * 6 + 2 * mc + b for a in range(2) for b in range(2)])
    assert second.tolist() == expected


def test_grid_of_the_largest_side_builds():
    grid = build_packed_grid([[512, 512]], CONFIG)
    assert grid.num_patches == 512 * 512
    assert grid.positions[-1].tolist() == [511, 511]


def test_list_input_and_device():
    grid = build_packed_grid([(2, 2)], CONFIG, device="cpu")
    assert grid.grid_hws.dtype == torch.int64 and grid.grid_hws.tolist() == [[2, 2]]


@pytest.mark.parametrize(
    "grid_hws, error, message",
    [
        (torch.tensor([[2.0, 2.0]]), TypeError, "integer"),
        (torch.tensor([[True, True]]), TypeError, "integer"),
        (torch.tensor([2, 2]), TypeError, r"\(N, 2\)"),
        (torch.tensor([[1, 2, 2, 2]]), TypeError, r"\(N, 2\)"),
        (torch.zeros(0, 2, dtype=torch.int64), ValueError, "empty pack"),
        (torch.tensor([[2, 2], [0, 2]]), ValueError, "image 1: grid 0x2 has a non-positive side"),
        (torch.tensor([[-2, 2]]), ValueError, "non-positive"),
        (torch.tensor([[514, 2]]), ValueError, "exceeds the 512 patches per side"),
        (torch.tensor([[2, 2], [3, 4]]), ValueError, "image 1: grid 3x4 is not divisible by the 2x2 patch merger"),
        ("not a grid", TypeError, "grid_hws"),
    ],
)
def test_bad_grids_are_named(grid_hws, error, message):
    with pytest.raises(error, match=message):
        build_packed_grid(grid_hws, CONFIG)


def test_equal_grid_sizes_share_one_resampled_position_table():
    grid = build_packed_grid([[2, 2], [4, 2], [2, 2]], CONFIG)
    assert grid.pos_emb_index.shape == (4 + 8, 16)  # the distinct sizes 2x2 and 4x2 only
    assert grid.pos_emb_row.tolist() == [0, 1, 2, 3, *range(4, 12), 0, 1, 2, 3]
    alone = build_packed_grid([[4, 2]], CONFIG)
    assert alone.pos_emb_row is None
    assert torch.equal(grid.pos_emb_index[4:], alone.pos_emb_index)


def test_repeated_packs_come_from_the_cache():
    model = MoonViT(preset_config("tiny"))
    first = model.prepare_grid([[4, 6], [2, 2]])
    assert model.prepare_grid(torch.tensor([[4, 6], [2, 2]])) is first
    assert model.prepare_grid([[2, 2], [4, 6]]) is not first
    other_theta = MoonViT(preset_config("tiny", rope_theta=100.0)).prepare_grid([[4, 6], [2, 2]])
    assert other_theta is not first
    assert not torch.equal(other_theta.rope_rotation, first.rope_rotation)


def test_a_grid_built_in_inference_mode_serves_training():
    config = preset_config("tiny")
    with torch.inference_mode():
        grid = build_packed_grid([[6, 4]], config)
    assert not grid.rope_rotation.is_inference()
