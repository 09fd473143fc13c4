"""ONNX export: the NumPy inputs against build_packed_grid, the graph against the PyTorch model,
and ONNX Runtime on packs the export never saw."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers import make_checkpoint, tiny_model

from moonvit import PRESETS, MoonViT
from moonvit.model.grid import build_packed_grid
from moonvit.onnx import (
    INPUT_NAMES,
    export_onnx,
    input_names,
    onnx_config,
    onnx_inputs,
    output_names,
)
from moonvit.onnx import export as export_module
from moonvit.onnx.__main__ import main as onnx_main
from moonvit.onnx.export import compare_with_model
from moonvit.onnx.graph import OnnxEncoder
from moonvit_projector import MoonViTProjector, ProjectorConfig

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

IMAGE_PACKS = {
    "one image": [(6, 8)],
    "odd aspect ratios": [(2, 30), (28, 2), (4, 6)],
    "repeated sizes": [(4, 4), (8, 6), (4, 4)],
    "32 images": [(2 * (1 + i % 3), 2 * (1 + i % 4)) for i in range(32)],
}
CLIP_PACKS = {
    "one clip": [(4, 6, 8)],
    "clips and images": [(3, 4, 6), (1, 2, 10), (2, 8, 2), (1, 4, 6)],
    "one small image": [(1, 2, 2)],
    "32 items": [(1 + i % 4, 2, 2 * (1 + i % 3)) for i in range(32)],
}
K25 = {"init_pos_emb_time": 4}
K3 = PRESETS["tiny-v2"]  # tiny's sizes with Kimi K3's switches (RMSNorm, no biases, bilinear, attention 96)


def pixels_for(grids, seed: int = 0) -> np.ndarray:
    patches = sum(int(np.prod(g)) for g in grids)
    return np.random.default_rng(seed).standard_normal((patches, 3, 14, 14)).astype(np.float32)


def all_packs():
    return (
        [pytest.param({}, g, id=n) for n, g in IMAGE_PACKS.items()]
        + [pytest.param(K25, g, id=f"k25 {n}") for n, g in CLIP_PACKS.items()]
        + [pytest.param(K3, g, id=f"k3 {n}") for n, g in CLIP_PACKS.items()]
    )


# ---- the inputs, against the model's own grid ---------------------------------------------------


@pytest.mark.parametrize(("overrides", "grids"), all_packs())
def test_inputs_match_the_packed_grid(overrides, grids):
    model = tiny_model(**overrides)
    feeds = onnx_inputs(model.config, pixels_for(grids), np.array(grids))
    grid = build_packed_grid(grids, model.config)
    L = grid.num_patches
    assert list(feeds) == list(input_names(model.config))
    np.testing.assert_array_equal(feeds["positions"], grid.positions.numpy())

    # Position taps: each row reads the same 16 taps with the same weights, to the bit.
    rows = np.arange(L) if grid.pos_emb_row is None else grid.pos_emb_row.numpy()
    np.testing.assert_array_equal(feeds["pos_emb_index"][feeds["pos_emb_row"]], grid.pos_emb_index.numpy()[rows])
    np.testing.assert_array_equal(
        feeds["pos_emb_weight"][feeds["pos_emb_row"]], grid.pos_emb_weight.float().numpy()[rows]
    )
    if model.config.init_pos_emb_time:
        expected_time = np.zeros(L, dtype=np.int64) if grid.time_index is None else grid.time_index.numpy()
        np.testing.assert_array_equal(feeds["time_index"], expected_time)

    # Attention: each item's rows, padded with -1; the slots invert that layout.
    rows_of = feeds["attention_rows"]
    cu = grid.cu_seqlens.tolist()
    assert rows_of.shape == (grid.num_items, grid.max_seqlen)
    for i, (start, end) in enumerate(itertools.pairwise(cu)):
        np.testing.assert_array_equal(rows_of[i, : end - start], np.arange(start, end))
        assert (rows_of[i, end - start :] == -1).all()
    np.testing.assert_array_equal(rows_of.reshape(-1)[feeds["attention_slots"]], np.arange(L))

    # Merge: the model's merge order (images) or its pooling of frames (clips).
    index, weight = feeds["merge_index"], feeds["merge_weight"]
    assert index.shape[:2] == (grid.num_slots // 4, 4) and index.shape[2] == grid.max_frames
    flat_index, flat_weight = index.reshape(grid.num_slots, -1), weight.reshape(grid.num_slots, -1)
    if grid.merge_index is not None:
        np.testing.assert_array_equal(flat_index[:, 0], grid.merge_index.numpy())
        assert (flat_weight == 1).all()
    else:
        assert grid.pool_index is not None and grid.pool_weight is not None
        for row, (slot, w) in enumerate(zip(grid.pool_index.tolist(), grid.pool_weight.tolist())):
            frame = int(np.flatnonzero(flat_index[slot] == row)[0])
            assert flat_weight[slot, frame] == np.float32(w)
        np.testing.assert_allclose(flat_weight.sum(1), 1.0, rtol=1e-6)


def test_inputs_take_lists_and_torch_tensors():
    config = tiny_model().config
    grids = [(4, 6), (2, 2)]
    pixels = pixels_for(grids)
    from_numpy = onnx_inputs(config, pixels, np.array(grids))
    from_torch = onnx_inputs(config, torch.from_numpy(pixels), torch.tensor(grids))
    from_list = onnx_inputs(config, pixels, grids)
    for name in from_numpy:
        np.testing.assert_array_equal(from_torch[name], from_numpy[name])
        np.testing.assert_array_equal(from_list[name], from_numpy[name])
    assert from_numpy["pixel_values"].dtype == np.float32
    assert set(INPUT_NAMES) - set(from_numpy) == {"time_index"}


# ---- bad input: the model's own errors -----------------------------------------------------------

BAD_PACKS = [
    pytest.param({}, [(3, 4)], None, id="odd side"),
    pytest.param({}, [(4, 4), (2, 514)], None, id="side over the RoPE table"),
    pytest.param({}, [(0, 4)], None, id="non-positive side"),
    pytest.param({}, [(4, 4)], 15, id="patch count mismatch"),
    pytest.param(K25, [(2, 4, 4), (1, 2, 2)], 19, id="clip patch count mismatch"),
    pytest.param(K25, [(5, 2, 2)], None, id="frames over the temporal table"),
    pytest.param({}, [(2, 2, 2)], None, id="clip for an image-only tower"),
    pytest.param({}, np.zeros((0, 2), dtype=np.int64), None, id="empty pack"),
    pytest.param({}, [[1, 2, 3, 4]], None, id="bad grid shape"),
]


@pytest.mark.parametrize(("overrides", "grids", "patches"), BAD_PACKS)
def test_bad_input_raises_the_models_error(overrides, grids, patches):
    model = tiny_model(**overrides)
    grid = np.asarray(grids, dtype=np.int64)
    count = patches if patches is not None else max(int(np.prod(grid, axis=1).sum()) if grid.size else 1, 1)
    pixels = np.zeros((count, 3, 14, 14), dtype=np.float32)
    with pytest.raises((TypeError, ValueError)) as from_model:
        model(torch.from_numpy(pixels), torch.from_numpy(grid))
    with pytest.raises(from_model.type) as from_onnx:
        onnx_inputs(model.config, pixels, grid)
    assert str(from_onnx.value) == str(from_model.value)


def test_bad_dtypes_are_named():
    config = tiny_model().config
    with pytest.raises(TypeError, match="grid_hws must be an integer tensor, got dtype float64"):
        onnx_inputs(config, np.zeros((16, 3, 14, 14), np.float32), np.array([[4.0, 4.0]]))
    with pytest.raises(TypeError, match="pixel_values must be floating"):
        onnx_inputs(config, np.zeros((16, 3, 14, 14), np.uint8), [(4, 4)])
    with pytest.raises(ValueError, match=r"pixel_values must have shape \(L, 3, 14, 14\)"):
        onnx_inputs(config, np.zeros((16, 3, 16, 16), np.float32), [(4, 4)])
    with pytest.raises(TypeError, match="grid_hws must be an"):
        onnx_inputs(config, np.zeros((16, 3, 14, 14), np.float32), [(4, 4), (2,)])


# ---- the exported forward, in PyTorch ------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "grids"), all_packs())
def test_graph_forward_matches_the_model(overrides, grids):
    model = tiny_model(**overrides)
    pixels = pixels_for(grids)
    feeds = {k: torch.from_numpy(v) for k, v in onnx_inputs(model.config, pixels, grids).items()}
    graph = OnnxEncoder(model).eval()
    with torch.no_grad():
        last, merged = graph(**feeds)
        out = model(torch.from_numpy(pixels), grids)
    assert last.shape == out.last_hidden_state.shape and merged.shape == out.merged.shape
    torch.testing.assert_close(last, out.last_hidden_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, out.merged, rtol=1e-5, atol=1e-5)
    # RoPE from the positions: the model's rotation to the bit.
    grid = build_packed_grid(grids, model.config)
    assert torch.equal(graph.rope_rotation(feeds["positions"]), grid.rope_rotation)


# ---- exported graphs on ONNX Runtime ---------------------------------------------------------------


def session(path) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def vl_export(tmp_path_factory):
    """A Kimi-VL-shaped checkpoint with a projector, exported by the command line."""
    folder = make_checkpoint(tmp_path_factory.mktemp("vl") / "checkpoint")
    out = folder.parent / "encoder.onnx"
    summary = onnx_main(["--checkpoint", str(folder), "--out", str(out), "--projector"])
    encoder = MoonViT.from_pretrained(folder)
    projector = MoonViTProjector.from_pretrained(folder)
    return summary, out, encoder, projector


@pytest.fixture(scope="module")
def k25_export(tmp_path_factory):
    """A K2.5 tower (temporal table) and its projector, exported through the API, its weights in a
    separate data file as a graph over protobuf's 2 GB limit has them."""
    encoder = tiny_model(seed=3, **K25)
    torch.manual_seed(3)
    projector = MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, 48)).eval()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export_module, "SINGLE_FILE_BYTES", 0)
        path = export_onnx(encoder, tmp_path_factory.mktemp("k25") / "encoder.onnx", projector)
    return path, encoder, projector


def test_cli_exports_a_checked_graph(vl_export):
    summary, path, encoder, _ = vl_export
    onnx.checker.check_model(str(path), full_check=True)
    assert summary["outputs"] == ["last_hidden_state", "merged", "projected"]
    assert summary["inputs"] == list(input_names(encoder.config))
    assert max(summary["check"].values()) < 1e-4
    model = onnx.load(str(path))
    # Every pack-dependent size is symbolic: one graph for any pack.
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["pixel_values"] == ["patches", 3, 14, 14]
    assert dims["attention_rows"] == ["items", "longest"]
    assert dims["pos_emb_index"] == ["position_rows", 16]
    assert dims["merge_index"] == ["tokens", 4, 1]
    ops = {node.op_type for node in model.graph.node}
    assert not ops & {"Loop", "Scan", "If"}, ops


@pytest.mark.parametrize("name", list(IMAGE_PACKS))
def test_onnxruntime_matches_pytorch_on_unseen_image_packs(vl_export, name):
    _, path, encoder, projector = vl_export
    grids = IMAGE_PACKS[name]
    errors = compare_with_model(session(path), encoder, pixels_for(grids, seed=5), grids, projector)
    assert set(errors) == {"last_hidden_state", "merged", "projected"}
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("name", list(CLIP_PACKS))
def test_onnxruntime_matches_pytorch_on_unseen_clip_packs(k25_export, name):
    path, encoder, projector = k25_export
    grids = CLIP_PACKS[name]
    errors = compare_with_model(session(path), encoder, pixels_for(grids, seed=6), grids, projector)
    assert max(errors.values()) < 1e-4, errors


@pytest.fixture(scope="module")
def k3_export(tmp_path_factory):
    """A Kimi K3 tower (MoonViT-V2 switches) and its patchmergerv2 projector, exported through the API."""
    encoder = tiny_model(seed=7, **K3)
    projector = MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, 48, projector_type="patchmergerv2"))
    path = export_onnx(encoder, tmp_path_factory.mktemp("k3") / "encoder.onnx", projector.eval())
    return path, encoder, projector


@pytest.mark.parametrize("name", ["clips and images", "32 items"])
def test_a_k3_graph_matches_pytorch_on_packs_it_never_saw(k3_export, name):
    path, encoder, projector = k3_export
    grids = CLIP_PACKS[name] + [(1, 2, 68), (1, 66, 4)]  # the export traced another pack; odd aspects resample
    errors = compare_with_model(session(path), encoder, pixels_for(grids, seed=8), grids, projector)
    assert set(errors) == {"last_hidden_state", "merged", "projected"}
    assert max(errors.values()) < 1e-4, errors
    assert onnx_config(session(path)) == encoder.config


def test_graph_carries_its_config(k25_export):
    path, encoder, _ = k25_export
    assert [p.name for p in path.parent.iterdir()] != [path.name]  # the weights beside the graph
    onnx.checker.check_model(str(path), full_check=True)
    sess = session(path)
    assert onnx_config(sess) == encoder.config
    assert [i.name for i in sess.get_inputs()] == list(INPUT_NAMES)
    assert [o.name for o in sess.get_outputs()] == list(output_names(True))


def test_fp16_graph(tmp_path):
    encoder = tiny_model(seed=4, **K25)
    encoder.save_pretrained(tmp_path / "checkpoint")
    out = tmp_path / "encoder16.onnx"
    summary = onnx_main(["--checkpoint", str(tmp_path / "checkpoint"), "--out", str(out), "--dtype", "fp16"])
    assert max(summary["check"].values()) < 2e-2
    grids = CLIP_PACKS["clips and images"]
    last, merged = session(out).run(None, onnx_inputs(encoder.config, pixels_for(grids), grids))
    assert last.dtype == np.float16 and merged.dtype == np.float16


# ---- refusals -------------------------------------------------------------------------------------


def test_export_refuses_what_it_cannot_write(tmp_path):
    encoder = tiny_model()
    with pytest.raises(ValueError, match="float32 or float16"):
        export_onnx(tiny_model(dtype=torch.bfloat16), tmp_path / "a.onnx")
    with pytest.raises(ValueError, match="opset must lie in 18..23"):
        export_onnx(encoder, tmp_path / "a.onnx", opset=17)
    wide = MoonViTProjector(ProjectorConfig(vision_hidden_size=32, text_hidden_size=8))
    with pytest.raises(ValueError, match="the projector takes 32-wide groups"):
        export_onnx(encoder, tmp_path / "a.onnx", wide)
    half = MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, 8)).half()
    with pytest.raises(ValueError, match="export both in one dtype"):
        export_onnx(encoder, tmp_path / "a.onnx", half)
    assert not (tmp_path / "a.onnx").exists()


def test_cli_refusals(tmp_path, capsys):
    folder = make_checkpoint(tmp_path / "checkpoint", projector=False)
    with pytest.raises(SystemExit) as exit_info:
        onnx_main(["--checkpoint", str(folder), "--out", str(tmp_path / "a.onnx"), "--opset", "12"])
    assert exit_info.value.code == 2
    assert "expected an ONNX opset from 18 to 23, got 12" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        onnx_main(["--checkpoint", str(folder), "--out", str(tmp_path / "a.onnx"), "--projector"])
    assert exit_info.value.code == 1
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "a.onnx").exists()
