"""ONNX export of the classic ViT / DeiT tower and the VLA stacks' ViTs it runs (SigLIP, SigLIP2 NaFlex,
DINOv2 with registers): the NumPy inputs against torch's interpolation and the tower's own table, the
exported forward against the eager tower, and ONNX Runtime on packs the export never saw (mixed and odd
grids, through one exported file)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import randomise_
from transformers import ViTConfig, ViTForImageClassification

from moonvit import MoonViT
from moonvit.families.vit import ClassicViT, ClassicViTConfig
from moonvit.onnx import VIT_INPUT_NAMES, export_onnx, input_names, onnx_config, onnx_inputs, vit_output_names
from moonvit.onnx.__main__ import main as onnx_main
from moonvit.onnx.export import compare_with_model
from moonvit.onnx.vit_graph import OnnxClassicViT
from moonvit.onnx.vit_inputs import axis_weights

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

PATCH = 16
# A 128 px tower at patch 16: an 8 x 8 table, so that the packs both shrink and grow it.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=128)
CLASSES = 5
# Two packs the export never saw: the native grid, odd sides, a repeated size, 1 x 1, growing and shrinking.
PACK_A = [(8, 8), (3, 5), (13, 3), (1, 1), (3, 5)]
PACK_B = [(5, 11), (2, 2), (9, 7)]
TOWERS = {
    "cls head pooler": dict(num_classes=CLASSES, pooler=True),
    "deit distilled timm": dict(
        distillation_token=True, num_classes=CLASSES, distilled_head=True, pos_emb_rule="timm", layer_norm_eps=1e-6
    ),
    "cls avg jax": dict(pool="avg", num_classes=CLASSES, pos_emb_rule="jax"),
    "gap": dict(class_token=False, pool="avg"),
    # SigLIP: no prefix tokens, the MAP head, tanh GELU, transformers' bicubic
    "siglip": dict(class_token=False, pool="map", hidden_act="gelu_tanh", layer_norm_eps=1e-6),
    # SigLIP2 NaFlex: the same with the antialiased bilinear table (at every grid), a head on the MAP output
    "siglip2 naflex": dict(
        class_token=False, pool="map", hidden_act="gelu_tanh", pos_emb_rule="naflex", num_classes=CLASSES
    ),
    # DINOv2 (transformers' Dinov2Model): CLS with its table row, LayerScale, bicubic in float32
    "dinov2": dict(layer_scale=True, pos_emb_rule="transformers-f32", layer_norm_eps=1e-6),
    # DINOv2 with registers (timm's reg4, giant's SwiGLU): a patch-only table, PIL's antialiased bicubic
    "dinov2 reg swiglu": dict(
        num_register_tokens=4,
        layer_scale=True,
        mlp_type="swiglu",
        no_embed_class=True,
        pos_emb_rule="timm",
        num_classes=CLASSES,
    ),
}
NEW_TOWERS = ["siglip", "siglip2 naflex", "dinov2", "dinov2 reg swiglu"]
# torch's kernels, called as each rule calls them (the tower's resample_table).
INTERPOLATE = {
    "transformers": dict(mode="bicubic", align_corners=False),
    "timm": dict(mode="bicubic", antialias=True, align_corners=False),
    "jax": dict(mode="bilinear", align_corners=True),
    "transformers-f32": dict(mode="bicubic", align_corners=False),
    "naflex": dict(mode="bilinear", antialias=True, align_corners=False),
}


def tower(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> ClassicViT:
    model = ClassicViT(ClassicViTConfig(**TINY, **TOWERS[name]))
    return randomise_(model, seed).to(dtype).eval()


def pixels_for(grids: list[tuple[int, int]], seed: int = 0) -> np.ndarray:
    patches = sum(h * w for h, w in grids)
    return np.random.default_rng(seed).standard_normal((patches, 3, PATCH, PATCH)).astype(np.float32)


def session(path) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


# ---- the inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", list(INTERPOLATE))
@pytest.mark.parametrize("side", [4, 7, 14])
def test_axis_weights_are_torchs_interpolation(rule, side):
    """Each rule's weights along one axis are F.interpolate's (in float64) of each table row alone."""
    basis = torch.eye(side, dtype=torch.float64).reshape(1, side, 1, side)  # channel c: table row c alone
    for size in range(1, 3 * side + 2):
        expected = F.interpolate(basis, size=(1, size), **INTERPOLATE[rule])[0, :, 0, :].T.numpy()
        np.testing.assert_allclose(axis_weights(size, side, rule), expected, rtol=0, atol=1e-12, err_msg=str(size))


@pytest.mark.parametrize("name", ["cls head pooler", "deit distilled timm", "cls avg jax", *NEW_TOWERS])
def test_inputs_resample_the_towers_table(name):
    """The per-axis weights, multiplied out over the table, give each patch its item's row of the
    tower's own resampled table (float32 weights: to 1e-6); each distinct size is resampled once."""
    model = tower(name, dtype=torch.float64)
    feeds = onnx_inputs(model.config, pixels_for(PACK_A), PACK_A)
    assert list(feeds) == list(VIT_INPUT_NAMES) == list(input_names(model.config))
    weight_h, weight_w, row = feeds["pos_emb_weight_h"], feeds["pos_emb_weight_w"], feeds["pos_emb_row"]
    distinct = {tuple(g) for g in PACK_A}
    assert weight_h.shape == weight_w.shape == (sum(h * w for h, w in distinct), model.config.grid_side)
    assert weight_h.dtype == np.float32 and row.dtype == np.int64
    table = model.pos_embed[0, model.config.num_table_prefix_rows :].detach().numpy()
    grid_table = table.reshape(8, 8, -1)
    resampled = np.einsum("ui,uj,ijd->ud", weight_h.astype(np.float64), weight_w.astype(np.float64), grid_table)
    expected = torch.cat([model.position_table(h, w).flatten(0, 1) for h, w in PACK_A]).detach().numpy()
    np.testing.assert_allclose(resampled[row], expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    # The native grid's rows are the table's own, to the bit.
    np.testing.assert_array_equal(resampled[row[:64]], table)


@pytest.mark.parametrize("name", ["cls head pooler", "deit distilled timm", "gap", "dinov2 reg swiglu"])
def test_attention_layout(name):
    """Item i's token rows: its prefix tokens (rows i * n + k), then its patches (rows N * n + packed row),
    -1 past its end; the slots place every patch row in that padded batch."""
    config = tower(name).config
    n, items = config.num_prefix_tokens, len(PACK_A)
    feeds = onnx_inputs(config, pixels_for(PACK_A), PACK_A)
    rows, slots = feeds["attention_rows"], feeds["attention_slots"]
    sizes = [h * w for h, w in PACK_A]
    assert rows.shape == (items, max(sizes) + n)
    starts = [0, *itertools.accumulate(sizes)]
    for i, size in enumerate(sizes):
        np.testing.assert_array_equal(rows[i, :n], i * n + np.arange(n))
        np.testing.assert_array_equal(rows[i, n : n + size], items * n + np.arange(starts[i], starts[i + 1]))
        assert (rows[i, n + size :] == -1).all()
    np.testing.assert_array_equal(rows.reshape(-1)[slots], items * n + np.arange(sum(sizes)))


BAD_PACKS = [
    pytest.param([(4, 4), (2, 513)], None, id="side over max_grid_side"),
    pytest.param([(0, 4)], None, id="non-positive side"),
    pytest.param([(3, 5)], 14, id="patch count mismatch"),
    pytest.param([(2, 2, 2)], None, id="a clip"),
    pytest.param(np.zeros((0, 2), dtype=np.int64), None, id="empty pack"),
    pytest.param([[1, 2, 3, 4]], None, id="bad grid shape"),
]


@pytest.mark.parametrize(("grids", "patches"), BAD_PACKS)
def test_bad_input_raises_the_towers_error(grids, patches):
    model = tower("cls head pooler")
    grid = np.asarray(grids, dtype=np.int64)
    count = patches if patches is not None else max(int(np.prod(grid, axis=1).sum()) if grid.size else 1, 1)
    pixels = np.zeros((count, 3, PATCH, PATCH), dtype=np.float32)
    with pytest.raises((TypeError, ValueError)) as from_model:
        model(torch.from_numpy(pixels), torch.from_numpy(grid))
    with pytest.raises(from_model.type) as from_onnx:
        onnx_inputs(model.config, pixels, grid)
    assert str(from_onnx.value) == str(from_model.value)
    with pytest.raises(ValueError, match=r"pixel_values must have shape \(L, 3, 16, 16\)"):
        onnx_inputs(model.config, np.zeros((4, 3, 14, 14), np.float32), [(2, 2)])


# ---- the exported forward, in PyTorch ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(TOWERS))
def test_graph_forward_matches_the_tower(name):
    model = tower(name)
    pixels = pixels_for(PACK_A)
    feeds = {k: torch.from_numpy(v) for k, v in onnx_inputs(model.config, pixels, PACK_A).items()}
    with torch.no_grad():
        got = OnnxClassicViT(model).eval()(**feeds)
        out = model(torch.from_numpy(pixels), PACK_A)
    names = vit_output_names(model.config)
    assert len(got) == len(names)
    for output, actual in zip(names, got):
        expected = getattr(out, output)
        assert actual.shape == expected.shape, output
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()), msg=output)


def test_output_names_follow_the_config():
    assert vit_output_names(tower("cls head pooler").config) == (
        "last_hidden_state",
        "prefix_tokens",
        "pooled",
        "logits",
        "pooler_output",
    )
    assert vit_output_names(tower("deit distilled timm").config) == (
        "last_hidden_state",
        "prefix_tokens",
        "pooled",
        "logits",
        "head_logits",
    )
    assert vit_output_names(tower("gap").config) == ("last_hidden_state", "pooled")
    assert vit_output_names(tower("siglip").config) == ("last_hidden_state", "pooled")
    assert vit_output_names(tower("siglip2 naflex").config) == ("last_hidden_state", "pooled", "logits")
    assert vit_output_names(tower("dinov2 reg swiglu").config) == (
        "last_hidden_state",
        "prefix_tokens",
        "pooled",
        "logits",
    )


# ---- exported graphs on ONNX Runtime ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def vit_export(tmp_path_factory):
    """transformers' ViTForImageClassification folder (CLS, head), exported by the command line."""
    folder = tmp_path_factory.mktemp("vit") / "checkpoint"
    torch.manual_seed(0)
    config = ViTConfig(**TINY, patch_size=PATCH, num_labels=CLASSES)
    randomise_(ViTForImageClassification(config), seed=1).save_pretrained(folder)
    out = folder.parent / "vit.onnx"
    summary = onnx_main(["--checkpoint", str(folder), "--out", str(out)])
    return summary, out, MoonViT.from_pretrained(folder)


@pytest.fixture(scope="module")
def deit_export(tmp_path_factory):
    """A DeiT tower with both heads and timm's antialiased table rule, exported through the API."""
    model = tower("deit distilled timm", seed=2)
    return export_onnx(model, tmp_path_factory.mktemp("deit") / "deit.onnx"), model


def test_cli_exports_a_checked_vit_graph(vit_export):
    summary, path, model = vit_export
    assert isinstance(model, ClassicViT) and model.config.num_classes == CLASSES
    onnx.checker.check_model(str(path), full_check=True)
    assert summary["inputs"] == list(VIT_INPUT_NAMES)
    assert summary["outputs"] == ["last_hidden_state", "prefix_tokens", "pooled", "logits"]
    assert max(summary["check"].values()) < 1e-4
    graph = onnx.load(str(path))
    # Every pack-dependent size is symbolic: one graph for any pack.
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    assert dims == {
        "pixel_values": ["patches", 3, PATCH, PATCH],
        "pos_emb_weight_h": ["position_rows", 8],
        "pos_emb_weight_w": ["position_rows", 8],
        "pos_emb_row": ["patches"],
        "attention_rows": ["items", "longest"],
        "attention_slots": ["patches"],
    }
    ops = {node.op_type for node in graph.graph.node}
    assert not ops & {"Loop", "Scan", "If", "Resize"}, ops
    # The weights are the graph's own (no table rows come in from outside).
    assert {i.name for i in graph.graph.input} == set(VIT_INPUT_NAMES)


@pytest.mark.parametrize("grids", [PACK_A, PACK_B], ids=["pack A", "pack B"])
def test_onnxruntime_matches_the_vit(vit_export, grids):
    _, path, model = vit_export
    errors = compare_with_model(session(path), model, pixels_for(grids, seed=5), grids)
    assert set(errors) == {"last_hidden_state", "prefix_tokens", "pooled", "logits"}
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("grids", [PACK_A, PACK_B], ids=["pack A", "pack B"])
def test_onnxruntime_matches_the_distilled_deit(deit_export, grids):
    path, model = deit_export
    errors = compare_with_model(session(path), model, pixels_for(grids, seed=6), grids)
    assert set(errors) == {"last_hidden_state", "prefix_tokens", "pooled", "logits", "head_logits"}
    assert max(errors.values()) < 1e-4, errors


def test_graphs_carry_their_config(vit_export, deit_export):
    for path, model in ((vit_export[1], vit_export[2]), deit_export):
        sess = session(path)
        config = onnx_config(sess)
        assert isinstance(config, ClassicViTConfig) and config == model.config
        assert [o.name for o in sess.get_outputs()] == list(vit_output_names(config))
        # The config read back is all the feeds need.
        feeds = onnx_inputs(config, pixels_for(PACK_B), PACK_B)
        outputs = dict(zip(vit_output_names(config), sess.run(None, feeds)))
        assert outputs["prefix_tokens"].shape == (len(PACK_B), config.num_prefix_tokens, config.hidden_size)
        assert outputs["last_hidden_state"].shape == (sum(h * w for h, w in PACK_B), config.hidden_size)


def test_a_gap_tower_exports(tmp_path):
    """A tower without prefix tokens: no prefix_tokens output, pooled the mean of each item's patch rows.
    (Against the exported forward in PyTorch: the eager tower cannot return a GAP tower's outputs.)"""
    model = tower("gap", seed=3)
    sess = session(export_onnx(model, tmp_path / "gap.onnx"))
    assert [o.name for o in sess.get_outputs()] == ["last_hidden_state", "pooled"]
    feeds = onnx_inputs(model.config, pixels_for(PACK_B, seed=7), PACK_B)
    last, pooled = sess.run(None, feeds)
    with torch.no_grad():
        expected_last, _ = OnnxClassicViT(model).eval()(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    np.testing.assert_allclose(last, expected_last.numpy(), rtol=0, atol=1e-4 * float(expected_last.abs().max()))
    sizes = [h * w for h, w in PACK_B]
    means = np.stack([rows.mean(0) for rows in np.split(last.astype(np.float64), np.cumsum(sizes)[:-1])])
    np.testing.assert_allclose(pooled, means, rtol=0, atol=1e-6 * np.abs(means).max())


def test_refusals(tmp_path, capsys):
    model = tower("cls head pooler")
    with pytest.raises(ValueError, match="has no projector"):
        export_onnx(model, tmp_path / "a.onnx", projector=nn.Linear(64, 8))
    model.save_pretrained(tmp_path / "checkpoint")
    with pytest.raises(SystemExit) as exit_info:
        onnx_main(["--checkpoint", str(tmp_path / "checkpoint"), "--out", str(tmp_path / "a.onnx"), "--projector"])
    assert exit_info.value.code == 1
    assert "classic ViT / DeiT tower, which has no projector: drop --projector" in capsys.readouterr().err
    assert not (tmp_path / "a.onnx").exists()


# ---- the VLA stacks' towers on ONNX Runtime: SigLIP, SigLIP2 NaFlex, DINOv2 with registers ----------


@pytest.fixture(scope="module")
def vla_exports(tmp_path_factory):
    """The three towers, each exported once through the API (random weights: LayerScale, the MAP head's
    latent query and the registers all away from their initial values)."""
    root = tmp_path_factory.mktemp("vla")
    exported = {}
    for seed, name in enumerate(["siglip", "siglip2 naflex", "dinov2 reg swiglu"], start=10):
        model = tower(name, seed=seed)
        exported[name] = export_onnx(model, root / f"{name.replace(' ', '_')}.onnx"), model
    return exported


@pytest.mark.parametrize("name", ["siglip", "siglip2 naflex", "dinov2 reg swiglu"])
def test_the_vla_towers_graphs_are_one_graph_without_control_flow(vla_exports, name):
    """No Loop / If (the MAP head's per-item softmax is segment ops: ScatterElements' max and sums over the
    L patch rows), no Resize (the table is resampled by the graph's own matmul); every pack size symbolic."""
    path, model = vla_exports[name]
    graph = onnx.load(str(path))
    ops = {node.op_type for node in graph.graph.node}
    assert not ops & {"Loop", "Scan", "If", "Resize"}, ops
    if model.config.pool == "map":
        assert "ScatterElements" in ops
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    assert dims["attention_rows"] == ["items", "longest"] and dims["pixel_values"] == ["patches", 3, PATCH, PATCH]
    assert [o.name for o in graph.graph.output] == list(vit_output_names(model.config))


@pytest.mark.parametrize("name", ["siglip", "siglip2 naflex", "dinov2 reg swiglu"])
def test_onnxruntime_matches_the_vla_towers_on_two_packs(vla_exports, name):
    """ONNX Runtime (CPU) against the eager tower on two packs the export never saw, through one file: every
    output to 1e-4 relative (measured: about 1e-6)."""
    path, model = vla_exports[name]
    sess = session(path)
    for seed, grids in enumerate([PACK_A, PACK_B]):
        errors = compare_with_model(sess, model, pixels_for(grids, seed=seed), grids)
        assert set(errors) == set(vit_output_names(model.config))
        assert max(errors.values()) < 1e-4, (grids, errors)


def test_the_graphs_map_head_pools_each_item_alone(vla_exports):
    """An item's pooled row in a pack is its pooled row alone (the softmax reads only the item's own patch
    rows), to float error (1e-5 relative), for items of 1 to 63 patches."""
    path, model = vla_exports["siglip2 naflex"]
    sess = session(path)
    grids = [(1, 1), (9, 7), (2, 2), (5, 11)]
    pixels = pixels_for(grids, seed=8)
    pooled = sess.run(["pooled"], onnx_inputs(model.config, pixels, grids))[0]
    starts = [0, *itertools.accumulate(h * w for h, w in grids)]
    for i, grid in enumerate(grids):
        alone = sess.run(["pooled"], onnx_inputs(model.config, pixels[starts[i] : starts[i + 1]], [grid]))[0]
        np.testing.assert_allclose(pooled[i : i + 1], alone, rtol=0, atol=1e-5 * np.abs(alone).max(), err_msg=str(grid))


def test_cli_exports_a_transformers_dinov2_with_registers_folder(tmp_path):
    """transformers' Dinov2WithRegistersModel folder (registers, SwiGLU, LayerScale, its antialiased bicubic table)
    exports through the command line, which checks it against the loaded tower (to 1e-4) on its own pack; two packs
    of ours through the same file agree too."""
    from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

    config = Dinov2WithRegistersConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=128, patch_size=PATCH,
        num_register_tokens=2, use_swiglu_ffn=True,
    )  # fmt: skip
    randomise_(Dinov2WithRegistersModel(config), seed=4).save_pretrained(tmp_path / "dinov2")
    summary = onnx_main(["--checkpoint", str(tmp_path / "dinov2"), "--out", str(tmp_path / "dinov2.onnx")])
    assert summary["outputs"] == ["last_hidden_state", "prefix_tokens", "pooled"]
    assert max(summary["check"].values()) < 1e-4, summary["check"]
    model = MoonViT.from_pretrained(tmp_path / "dinov2")
    assert isinstance(model, ClassicViT) and model.config.num_register_tokens == 2
    sess = session(tmp_path / "dinov2.onnx")
    for seed, grids in enumerate([PACK_A, PACK_B]):
        errors = compare_with_model(sess, model, pixels_for(grids, seed=seed), grids)
        assert max(errors.values()) < 1e-4, (grids, errors)


def test_openvlas_fused_backbone_is_refused_by_name(tmp_path, capsys):
    """Two towers on one pack (OpenVLA's) are not one tower: the API and the command line say so, writing nothing."""
    from moonvit.families.openvla.config import FusedBackboneConfig
    from moonvit.families.openvla.model import FusedBackbone

    config = FusedBackboneConfig(
        featurizer=ClassicViTConfig(**TINY, **{**TOWERS["dinov2 reg swiglu"], "num_classes": 0}),
        fused_featurizer=ClassicViTConfig(**TINY, **TOWERS["siglip"]),
        text_hidden_size=None,
        image_size=128,
    )
    fused = FusedBackbone(config)
    with pytest.raises(ValueError, match=r"one MoonViT or ViT tower .*, not the .*\(FusedBackbone\)"):
        export_onnx(fused, tmp_path / "fused.onnx")
    fused.save_pretrained(tmp_path / "fused")
    with pytest.raises(SystemExit) as exit_info:
        onnx_main(["--checkpoint", str(tmp_path / "fused"), "--out", str(tmp_path / "fused.onnx")])
    assert exit_info.value.code == 1
    assert "(FusedBackbone): python -m moonvit.onnx exports one MoonViT or ViT tower" in capsys.readouterr().err
    assert not (tmp_path / "fused.onnx").exists()


def test_cli_exports_a_transformers_siglip2_naflex_folder(tmp_path):
    """transformers' Siglip2VisionModel folder (its NaFlex table, the MAP head, tanh GELU) exports through the command
    line, checked against the loaded tower (to 1e-4); two packs of ours through the same file agree too."""
    from transformers import Siglip2VisionConfig, Siglip2VisionModel

    config = Siglip2VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, patch_size=PATCH,
        num_patches=64,
    )  # fmt: skip
    randomise_(Siglip2VisionModel(config), seed=5).save_pretrained(tmp_path / "siglip2")
    summary = onnx_main(["--checkpoint", str(tmp_path / "siglip2"), "--out", str(tmp_path / "siglip2.onnx")])
    assert summary["outputs"] == ["last_hidden_state", "pooled"]
    assert max(summary["check"].values()) < 1e-4, summary["check"]
    model = MoonViT.from_pretrained(tmp_path / "siglip2")
    assert isinstance(model, ClassicViT) and (model.config.pool, model.config.pos_emb_rule) == ("map", "naflex")
    sess = session(tmp_path / "siglip2.onnx")
    for seed, grids in enumerate([PACK_A, PACK_B]):
        errors = compare_with_model(sess, model, pixels_for(grids, seed=seed), grids)
        assert max(errors.values()) < 1e-4, (grids, errors)
