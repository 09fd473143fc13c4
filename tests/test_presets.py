"""Every preset in ``moonvit.PRESETS``, as timm's ``test_models.py`` runs every model.

Each preset is built at its own width, heads, norms and switches, but with one block where it
ships with many (``so400m``, ``so400m-3d``, ``moonvit-v2``: 27 blocks), so the whole file stays
quick on a small CPU. Checks: forward shapes and finite values on a pack of images (and a pack
with a 2-frame clip where the preset has a temporal table), finite gradients for every
parameter, a pack equal to its items one by one, a bit-exact save/load round trip, and ONNX
Runtime parity on a small preset where onnx and onnxruntime are installed.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from helpers import randomize_

from moonvit import PRESETS, MoonViT, preset_config

BIG = {name for name in PRESETS if preset_config(name).num_hidden_layers > 6}
ONNX = ["tiny-v2"]
"""ONNX Runtime parity on one small preset (an export takes ~20 s): K3's switches and a temporal table;
tests/test_onnx.py covers tiny and tiny-3d's shapes."""
IMAGES = [(1, 2, 4), (1, 4, 2), (1, 2, 2)]
CLIP = [(2, 2, 4), (1, 4, 2)]
PACK_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
"""fp32: a pack against its items one by one (the same kernels on fewer rows)."""


def build(name: str) -> MoonViT:
    overrides = {"num_hidden_layers": 1} if name in BIG else {}
    model = MoonViT(preset_config(name, **overrides))
    return randomize_(model, seed=0).float().eval()


def packs(name: str) -> list[list[tuple[int, int, int]]]:
    return [IMAGES, CLIP] if preset_config(name).init_pos_emb_time else [IMAGES]


def pixels(grids: list[tuple[int, int, int]], patch_size: int, seed: int = 0) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(rows, 3, patch_size, patch_size, generator=gen) * 2 - 1


@pytest.fixture(scope="module", params=list(PRESETS))
def preset(request):
    return request.param, build(request.param)


def test_big_presets_are_the_ones_shrunk():
    assert {"so400m", "so400m-3d", "moonvit-v2"} == BIG
    assert set(ONNX) <= set(PRESETS)


def test_forward_shapes_and_finite_values(preset):
    name, model = preset
    d, p = model.config.hidden_size, model.config.patch_size
    for grids in packs(name):
        with torch.no_grad():
            out = model(pixels(grids, p), torch.tensor(grids))
        rows = sum(t * h * w for t, h, w in grids)
        assert out.last_hidden_state.shape == (rows, d)
        assert out.merged is not None and out.merged.shape == (sum(h * w for _, h, w in grids) // 4, 4, d)
        assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.merged).all()


def test_backward_gives_finite_gradients_to_every_parameter(preset):
    name, model = preset
    grids = packs(name)[-1]
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = model(pixels(grids, model.config.patch_size), torch.tensor(grids))
        (out.last_hidden_state.square().mean() + out.merged.mean()).backward()
    missing = [n for n, param in model.named_parameters() if param.grad is None]
    assert not missing, f"{name}: no gradient for {missing}"
    bad = [n for n, param in model.named_parameters() if not torch.isfinite(param.grad).all()]
    assert not bad, f"{name}: non-finite gradients in {bad}"
    model.zero_grad(set_to_none=True)


def test_a_pack_equals_its_items_one_by_one(preset):
    name, model = preset
    p = model.config.patch_size
    for grids in packs(name):
        pack = pixels(grids, p, seed=1)
        with torch.no_grad():
            together = model(pack, torch.tensor(grids))
            rows, tokens = 0, 0
            for grid in grids:
                t, h, w = grid
                alone = model(pack[rows : rows + t * h * w], torch.tensor([grid]))
                torch.testing.assert_close(
                    together.last_hidden_state[rows : rows + t * h * w], alone.last_hidden_state, **PACK_TOLERANCE
                )
                merged = together.merged[tokens : tokens + h * w // 4]
                torch.testing.assert_close(merged, alone.merged, **PACK_TOLERANCE)
                rows, tokens = rows + t * h * w, tokens + h * w // 4


def test_save_and_load_round_trip_bit_exact(preset, tmp_path):
    name, model = preset
    model.save_pretrained(tmp_path)
    loaded = MoonViT.from_pretrained(tmp_path)
    assert loaded.config == model.config
    saved, read = model.state_dict(), loaded.state_dict()
    assert saved.keys() == read.keys()
    for key, tensor in saved.items():
        assert read[key].dtype == tensor.dtype and torch.equal(read[key], tensor), key
    grids = packs(name)[-1]
    pack = pixels(grids, model.config.patch_size, seed=2)
    with torch.no_grad():
        assert torch.equal(model(pack, torch.tensor(grids)).merged, loaded(pack, torch.tensor(grids)).merged)


@pytest.mark.skipif(
    importlib.util.find_spec("onnx") is None or importlib.util.find_spec("onnxruntime") is None,
    reason="onnx and onnxruntime are not installed",
)
@pytest.mark.parametrize("name", ONNX)
def test_onnx_export_matches_pytorch(name, tmp_path):
    import onnxruntime

    from moonvit.onnx.export import compare_with_model, export_onnx

    model = build(name)
    path = export_onnx(model, tmp_path / "encoder.onnx")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for grids in packs(name):
        pack = pixels(grids, model.config.patch_size, seed=3).numpy().astype(np.float32)
        errors = compare_with_model(session, model, pack, grids)
        assert max(errors.values()) < 1e-4, (name, grids, errors)
