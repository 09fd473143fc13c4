import pytest
import torch
import torch.nn.functional as F

from moonvit.model.position import LearnablePositionTable, resample_taps

GRIDS = [(1, 1), (1, 7), (2, 2), (3, 5), (17, 200), (63, 65), (64, 64), (96, 128), (512, 2)]


MODES = ["bicubic", "bilinear"]  # Kimi-VL and K2.5; Kimi K3


def resample(table: torch.Tensor, h: int, w: int, mode: str = "bicubic") -> torch.Tensor:
    module = LearnablePositionTable(*table.shape)
    module.weight.data = table
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    positions = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    taps, weights = resample_taps(
        positions, torch.full((h * w,), h), torch.full((h * w,), w), table.shape[0], table.shape[1], mode
    )
    assert taps.shape == (h * w, {"bicubic": 16, "bilinear": 4}[mode])
    return module(taps, weights).reshape(h, w, -1)


def interpolate(table: torch.Tensor, h: int, w: int, mode: str = "bicubic") -> torch.Tensor:
    resized = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode=mode, align_corners=False)
    return resized[0].permute(1, 2, 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("h,w", GRIDS)
def test_matches_f_interpolate_float64(h, w, mode):
    table = torch.randn(64, 64, 8, dtype=torch.float64) * 5
    torch.testing.assert_close(resample(table, h, w, mode), interpolate(table, h, w, mode), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("h,w", GRIDS)
def test_float32_is_as_accurate_as_f_interpolate(h, w, mode):
    table = torch.randn(64, 64, 8) * 5
    exact = interpolate(table.double(), h, w, mode)
    ours, torchs = resample(table, h, w, mode), interpolate(table, h, w, mode)
    # F.interpolate's own float32 index arithmetic drifts by ~1e-5 relative;
    # the taps here are computed in float64, so they are never further from exact.
    assert (ours.double() - exact).abs().max() <= (torchs.double() - exact).abs().max() + 1e-6
    torch.testing.assert_close(ours, torchs, rtol=1e-4, atol=2e-4)


def test_bfloat16_rounds_once():
    table = (torch.randn(64, 64, 16) * 5).bfloat16()
    ours = resample(table, 37, 90)
    assert ours.dtype == torch.bfloat16
    exact = interpolate(table.double(), 37, 90)
    # One rounding of the exact value to bf16: within half an ulp (at most 2^-8 relative).
    assert ((ours.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    torchs = interpolate(table, 37, 90)
    assert (ours.double() - exact).abs().max() <= (torchs.double() - exact).abs().max()


def test_non_square_table():
    table = torch.randn(48, 80, 4, dtype=torch.float64)
    torch.testing.assert_close(resample(table, 20, 30), interpolate(table, 20, 30))


def test_same_size_is_identity_and_weights_sum_to_one():
    table = torch.randn(64, 64, 4)
    assert torch.equal(resample(table, 64, 64), table)
    positions = torch.tensor([[0, 0], [5, 9], [12, 3]])
    _, weights = resample_taps(positions, torch.tensor([13, 13, 13]), torch.tensor([10, 10, 10]), 64, 64)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, dtype=torch.float64))


def test_gradient_reaches_table():
    module = LearnablePositionTable(64, 64, 4)
    positions = torch.tensor([[0, 0], [1, 1]])
    taps, weights = resample_taps(positions, torch.tensor([2, 2]), torch.tensor([2, 2]), 64, 64)
    module(taps, weights).sum().backward()
    assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0


def _pack_taps(sizes):
    rows, cols, heights, widths = [], [], [], []
    for h, w in sizes:
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(r.flatten()), cols.append(c.flatten())
        heights.append(torch.full((h * w,), h)), widths.append(torch.full((h * w,), w))
    positions = torch.stack([torch.cat(rows), torch.cat(cols)], dim=-1)
    return resample_taps(positions, torch.cat(heights), torch.cat(widths), 8, 8)


def _table(cache_patches: int = 1000) -> LearnablePositionTable:
    torch.manual_seed(0)
    return LearnablePositionTable(8, 8, 4, cache_patches=cache_patches)


def test_cached_rows_equal_a_fresh_resample_and_follow_weight_updates():
    module, sizes = _table(), [(3, 5), (2, 2)]
    taps, weights = _pack_taps(sizes)
    with torch.no_grad():
        first = module(taps, weights, sizes)
        assert set(module._cache) == set(sizes)
        torch.testing.assert_close(module(taps, weights, sizes), first, rtol=0, atol=0)
        # a pack reusing one cached size, alone
        torch.testing.assert_close(module(*_pack_taps([(2, 2)]), [(2, 2)]), first[15:], rtol=0, atol=0)

        module.weight.mul_(2)  # in-place update: version counter changes
        torch.testing.assert_close(module(taps, weights, sizes), module(taps, weights), rtol=0, atol=0)
        torch.testing.assert_close(module(taps, weights, sizes), 2 * first, rtol=1e-6, atol=1e-6)

        module.load_state_dict({"weight": torch.zeros(8, 8, 4)})
        assert module(taps, weights, sizes).abs().max() == 0
        module.double()
        assert module(taps, weights, sizes).dtype == torch.float64


def test_no_cache_while_the_table_is_trained():
    module, sizes = _table(), [(3, 5)]
    taps, weights = _pack_taps(sizes)
    module(taps, weights, sizes).sum().backward()
    assert not module._cache
    assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0


def test_cache_stays_within_its_patch_budget():
    module = _table(cache_patches=20)
    with torch.no_grad():
        for size in [(3, 5), (2, 2), (1, 3)]:
            module(*_pack_taps([size]), [size])
        assert list(module._cache) == [(2, 2), (1, 3)]  # 15 + 4 + 3 > 20: the oldest went
        module(*_pack_taps([(5, 5)]), [(5, 5)])  # larger than the budget: not kept, nothing evicted
        module(*_pack_taps([(3, 4), (3, 3)]), [(3, 4), (3, 3)])  # together over the budget: same
        assert list(module._cache) == [(2, 2), (1, 3)]


def test_cache_is_off_by_default_and_skipped_where_it_cannot_be_keyed():
    taps, weights = _pack_taps([(3, 5)])
    default = LearnablePositionTable(8, 8, 4)
    with torch.no_grad():
        default(taps, weights, [(3, 5)])
    assert not default._cache

    with torch.inference_mode():  # a table created in inference mode has no version counter
        module = _table()
        module.load_state_dict({"weight": torch.randn(8, 8, 4)}, assign=True)
        torch.testing.assert_close(module(taps, weights, [(3, 5)]), module(taps, weights))
    assert not module._cache


def test_copies_carry_no_cache():
    import copy
    import pickle

    module = _table()
    with torch.no_grad():
        module(*_pack_taps([(3, 5)]), [(3, 5)])
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert not clone._cache and clone.cache_patches == module.cache_patches
        with torch.no_grad():
            clone(*_pack_taps([(3, 5)]), [(3, 5)])
        assert list(clone._cache) == [(3, 5)]
