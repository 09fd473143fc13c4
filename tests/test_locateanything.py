"""NVIDIA LocateAnything-3B: its MoonViT (Kimi-VL's tower under ``vision_model.``), its ``mlp1``
projector and its prompt; parity with a plain reference written from the description, the release
folder read strictly and without its language-model shard, and every command line on it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import (
    FLEX,
    LOCATEANYTHING_SHARDS,
    SafeOpenSpy,
    locateanything_config,
    locateanything_tensors,
    run_export,
    tiny_locateanything,
    tiny_model,
    write_kimi_vl_folder,
    write_locateanything_folder,
)
from PIL import Image
from reference_locateanything import reference_locateanything
from safetensors.torch import load_file

import moonvit.weights.storage as storage
from moonvit import CheckpointError, MoonViT, MoonViTImageProcessor
from moonvit_projector import (
    IMG_CONTEXT_TOKEN_ID,
    MoonViTProjector,
    locateanything_image_ids,
    locateanything_prompt,
    splice_visual_tokens,
)

# Odd aspects: wide and tall strips, an image of the table's own 64 x 64, small ones.
GRIDS = [(6, 10), (2, 68), (66, 4), (4, 6), (64, 64)]
TEXT = 48


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def pack(grids, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(h * w for h, w in grids)
    pixels = torch.rand(n, 3, 14, 14, generator=gen, dtype=torch.float64) * 2 - 1
    return pixels.to(dtype), torch.tensor(grids, dtype=torch.int64)


@pytest.fixture(scope="module")
def exact():
    """The float64 reference on GRIDS, from the release's tensor names."""
    model, projector = tiny_locateanything(seed=3)
    pixels, grids = pack(GRIDS)
    heads = model.config.num_attention_heads
    with torch.no_grad():
        reference = reference_locateanything(locateanything_tensors(model, projector), heads, pixels, grids)
    return model, projector, pixels, grids, reference


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_float64_tower_merged_and_mlp1_match_the_reference(exact, impl):
    model, projector, pixels, grids, (last, merged, projected) = exact
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            out = model(pixels, grids)
            ours = projector(out.merged)
    finally:
        model.set_attn_implementation("auto")
    dim = model.config.hidden_size
    assert out.merged.shape == (merged.shape[0], 4, dim)
    assert rel(out.last_hidden_state, last) < 1e-5
    assert rel(out.merged.flatten(1), merged) < 1e-5  # LocateAnything's (h/2 * w/2, 4D): the same memory order
    assert ours.shape == (merged.shape[0], TEXT) and rel(ours, projected) < 1e-5


@pytest.mark.parametrize("impl", ["sdpa", FLEX])
def test_bfloat16_is_as_close_to_exact_as_the_reference_in_bfloat16(exact, impl):
    """Ours in bf16 no further from the float64 answer than the plain reference's own bf16 (25% slack)."""
    model, projector, pixels, grids, (last, merged, projected) = exact
    low, low_projector = model.to(torch.bfloat16), projector.to(torch.bfloat16)
    low.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            out = low(pixels.bfloat16(), grids)
            ours = low_projector(out.merged)
            heads = low.config.num_attention_heads
            ref = reference_locateanything(locateanything_tensors(low, low_projector), heads, pixels.bfloat16(), grids)
    finally:
        model.to(torch.float64), projector.to(torch.float64)
        model.set_attn_implementation("auto")
    for name, a, r, e in (
        ("tower", out.last_hidden_state, ref[0], last),
        ("merged", out.merged.flatten(1), ref[1], merged),
        ("projected", ours, ref[2], projected),
    ):
        assert rel(a, e) <= 1.25 * rel(r, e) + 1e-3, (name, rel(a, e), rel(r, e))


# ---- the release folder ---------------------------------------------------------------------------


def test_the_release_loads_tower_projector_and_processor_without_opening_the_language_model(tmp_path, monkeypatch):
    model, projector = tiny_locateanything(dtype=torch.float32)
    folder = write_locateanything_folder(tmp_path, model, projector)
    (folder / LOCATEANYTHING_SHARDS[1]).write_bytes(b"\xff" * 64)  # unreadable: opening it would fail
    spy = SafeOpenSpy(monkeypatch, storage)
    loaded = MoonViT.from_pretrained(folder)
    assert spy.opened == {LOCATEANYTHING_SHARDS[0]}
    assert loaded.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    loaded_projector = MoonViTProjector.from_pretrained(folder)
    assert loaded_projector.config.projector_type == "mlp1" and loaded_projector.config.text_hidden_size == TEXT
    assert loaded_projector.pre_norm is not None and loaded_projector.pre_norm.normalized_shape == (4 * 64,)
    merged = torch.randn(5, 4, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded_projector(merged), projector(merged), rtol=0, atol=0)
    assert MoonViTImageProcessor.from_pretrained(folder) == MoonViTImageProcessor.locateanything()
    assert MoonViTImageProcessor.from_pretrained(folder).in_token_limit == 25600


def test_a_missing_or_unexpected_tensor_is_refused_by_name(tmp_path):
    model, projector = tiny_locateanything(dtype=torch.float32)
    tensors = locateanything_tensors(model, projector)
    without_bias = {k: v for k, v in tensors.items() if k != "mlp1.3.bias"}
    folder = write_locateanything_folder(tmp_path / "a", model, projector, tensors=without_bias)
    MoonViT.from_pretrained(folder)  # the tower is whole
    with pytest.raises(CheckpointError, match=r"missing \['mlp1\.3\.bias'\]"):
        MoonViTProjector.from_pretrained(folder)

    without_wo = {k: v for k, v in tensors.items() if k != "vision_model.encoder.blocks.1.wo.weight"}
    folder = write_locateanything_folder(tmp_path / "b", model, projector, tensors=without_wo)
    with pytest.raises(CheckpointError, match=r"missing \['vision_model\.encoder\.blocks\.1\.wo\.weight'\]"):
        MoonViT.from_pretrained(folder)

    extra = {
        **tensors,
        "vision_model.encoder.blocks.0.attn.q_norm.weight": torch.ones(16),
        "mlp1.4.weight": torch.ones(2),
    }
    folder = write_locateanything_folder(tmp_path / "c", model, projector, tensors=extra)
    with pytest.raises(
        CheckpointError, match=r"unexpected \['vision_model\.encoder\.blocks\.0\.attn\.q_norm\.weight'\]"
    ):
        MoonViT.from_pretrained(folder)
    with pytest.raises(CheckpointError, match=r"unexpected \['mlp1\.4\.weight'\]"):
        MoonViTProjector.from_pretrained(folder)


def test_a_kimi_vl_tower_labelled_locateanything_and_the_reverse_are_refused(tmp_path):
    model, projector = tiny_locateanything(dtype=torch.float32)
    kimi = {k.replace("vision_model.", "vision_tower."): v for k, v in locateanything_tensors(model, projector).items()}
    folder = write_locateanything_folder(tmp_path / "mislabelled", model, projector, tensors=kimi)
    with pytest.raises(CheckpointError, match=r"says LocateAnything .*vision_model\.\*.*vision_tower\.\* is a Kimi-VL"):
        MoonViT.from_pretrained(folder)

    folder = write_locateanything_folder(tmp_path / "as-kimi", model, projector)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "kimi_vl"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"vision_model\.\* \(LocateAnything's names\).*model_type 'locateanything'"
    ):
        MoonViT.from_pretrained(folder)


def test_the_transformers_native_layout_in_review_is_refused_by_name(tmp_path):
    """PR #46776's names: model.vision_tower.blocks.N.attn.wqkv (q / k rows permuted), a projector
    with a post-merge norm. Refused, never loaded with its rows in the wrong order."""
    model, projector = tiny_locateanything(dtype=torch.float32)
    native = {}
    for name, tensor in locateanything_tensors(model, projector).items():
        name = name.replace("vision_model.encoder.blocks.", "model.vision_tower.blocks.")
        name = name.replace(".wqkv.", ".attn.wqkv.").replace(".wo.", ".attn.wo.")
        name = name.replace("vision_model.", "model.vision_tower.")
        for theirs, ours in (("mlp1.0", "pre_norm"), ("mlp1.1", "linear_1"), ("mlp1.3", "linear_2")):
            name = name.replace(f"{theirs}.", f"model.multi_modal_projector.{ours}.")
        native[name] = tensor
    folder = write_locateanything_folder(tmp_path, model, projector, tensors=native)
    with pytest.raises(CheckpointError, match="LocateAnything's transformers-native layout .*does not load"):
        MoonViT.from_pretrained(folder)
    with pytest.raises(CheckpointError, match="LocateAnything's transformers-native layout .*does not load"):
        MoonViTProjector.from_pretrained(folder)


def test_other_connector_depths_are_refused(tmp_path):
    model, projector = tiny_locateanything(dtype=torch.float32)
    config = locateanything_config(model, TEXT) | {"mlp_connector_layers": 3}
    folder = write_locateanything_folder(tmp_path, model, projector, config=config)
    with pytest.raises(CheckpointError, match="mlp_connector_layers 3 is not supported"):
        MoonViTProjector.from_pretrained(folder)


def test_own_format_round_trips_the_tower_projector_and_processor(tmp_path):
    model, projector = tiny_locateanything(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    projector.save_pretrained(tmp_path)
    MoonViTImageProcessor.locateanything().save_pretrained(tmp_path)
    loaded, loaded_projector = MoonViT.from_pretrained(tmp_path), MoonViTProjector.from_pretrained(tmp_path)
    assert loaded.config == model.config and loaded_projector.config == projector.config
    for a, b in ((loaded, model), (loaded_projector, projector)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert MoonViTImageProcessor.from_pretrained(tmp_path) == MoonViTImageProcessor.locateanything()


def test_kimi_vl_folders_are_read_as_before(tmp_path):
    model = tiny_model()
    folder = write_kimi_vl_folder(tmp_path, model, text_hidden_size=TEXT)
    loaded = MoonViT.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


# ---- the prompt ------------------------------------------------------------------------------------


def test_the_prompt_is_the_release_s_by_default_each_image_labelled_by_its_number():
    grids = [(32, 32), (6, 10)]  # 448 x 448: 256 tokens; 140 x 84: 15
    text = locateanything_prompt("<image-1> and <image-2>: where is the cat?", grids)
    # NVIDIA's LocateAnythingProcessor.replace_media_placeholder: f"<image {i+1}><img>{'<IMG_CONTEXT>' * n}</img>"
    release = "<image 1><img>" + "<IMG_CONTEXT>" * 256 + "</img> and <image 2><img>" + "<IMG_CONTEXT>" * 15 + "</img>"
    assert text == release + ": where is the cat?"
    assert locateanything_prompt("<image-1> and <image-2>: where is the cat?", grids, style="release") == text


def test_the_label_is_the_number_the_text_gives_the_image_counted_per_prompt():
    grids = [(2, 2), (2, 4), (4, 4)]  # 1, 2 and 4 tokens
    out = locateanything_prompt("<image-2> <image-3> <image-1>", grids)
    two, three = "<IMG_CONTEXT>" * 2, "<IMG_CONTEXT>" * 4
    assert out == f"<image 2><img>{two}</img> <image 3><img>{three}</img> <image 1><img><IMG_CONTEXT></img>"
    # a second prompt of a batch starts again at 1: its grid holds its own images only
    assert locateanything_prompt("<image-1>", grids[2:]) == "<image 1><img>" + "<IMG_CONTEXT>" * 4 + "</img>"


def test_the_vllm_form_has_the_markers_without_the_label():
    grids = [(32, 32), (6, 10)]
    text = locateanything_prompt("<image-2> and <image-1>: where is the cat?", grids, style="vllm")
    assert text == f"<img>{'<IMG_CONTEXT>' * 15}</img> and <img>{'<IMG_CONTEXT>' * 256}</img>: where is the cat?"
    with pytest.raises(ValueError, match="style must be one of"):
        locateanything_prompt("<image-1><image-2>", grids, style="sglang")  # type: ignore[arg-type]


def test_the_prompt_refers_to_each_image_once():
    grids = [(32, 32), (6, 10)]
    assert locateanything_image_ids(2) == [151666, 151665, 151665, 151667]
    with pytest.raises(ValueError, match="refers to <image-3>, but there are 2 images"):
        locateanything_prompt("<image-1><image-2><image-3>", grids)
    with pytest.raises(ValueError, match="image 2 is referred to 0 times"):
        locateanything_prompt("<image-1>", grids)


# The label ``<image N>`` as text ids (illustrative: any ids but the markers', as a tokenizer gives them).
LABEL_IDS = [27, 1805, 220, 16, 29]


@pytest.mark.parametrize("per_image", [False, True], ids=["packed", "per-image"])
def test_the_context_tokens_take_the_projected_rows_in_order_past_the_labels(per_image):
    first, second = [*LABEL_IDS, *locateanything_image_ids(2)], [*LABEL_IDS, *locateanything_image_ids(1)]
    ids = torch.tensor([[1, *first, 7, *second]])
    embeds = torch.zeros(1, ids.shape[1], 3)
    tokens = torch.arange(9.0).reshape(3, 3)
    features = [tokens[:2], tokens[2:]] if per_image else tokens
    out = splice_visual_tokens(ids, embeds, features, placeholder_token_id=IMG_CONTEXT_TOKEN_ID)
    context = (ids[0] == IMG_CONTEXT_TOKEN_ID).nonzero().flatten()
    assert context.tolist() == [7, 8, 17]
    assert torch.equal(out[0, context], tokens) and out[0].abs().sum() == tokens.sum()


# ---- downstream: every command line -----------------------------------------------------------------


def test_the_command_lines_take_a_locateanything_folder(tmp_path, capsys):
    from moonvit.__main__ import main as moonvit_main
    from moonvit.onnx.__main__ import main as onnx_main
    from moonvit_eval.linear_probe import main as probe_main

    model, projector = tiny_locateanything(dtype=torch.float32)
    folder = write_locateanything_folder(tmp_path / "la", model, projector)
    Image.new("RGB", (70, 42), (200, 40, 90)).save(tmp_path / "a.png")
    out = tmp_path / "main"
    moonvit_main(
        ["--checkpoint", str(folder), "--images", str(tmp_path / "a.png"), "--dtype", "fp32", "--out", str(out)]
    )
    header = "processor: LocateAnything-3B's rule: images 25600 patches, stretched to 28 px (sides over 511 refused)"
    assert header in capsys.readouterr().out.splitlines()
    summary = json.loads((out / "summary.json").read_text())["images"]
    assert summary[0]["grid_hw"] == [4, 6]  # 70 x 42 stretched to 84 x 56, not padded
    assert load_file(out / "merged.safetensors")["a.png"].shape == (6, 4, 64)

    (tmp_path / "inputs").mkdir()
    sizes = {"b.png": (100, 30), "c.png": (56, 28), "d.png": (29, 300)}
    for name, size in sizes.items():
        Image.new("RGB", size, (10, 200, 30)).save(tmp_path / "inputs" / name)
    run_export("--inputs", tmp_path / "inputs", "--checkpoint", folder, "--out", tmp_path / "export", "--store", "both")
    manifest = [json.loads(line) for line in (tmp_path / "export" / "manifest.jsonl").read_text().splitlines()]
    for entry in manifest:
        w, h = sizes[entry["id"].rsplit("/", 1)[-1]]
        assert entry["num_tokens"] == math.ceil(h / 28) * math.ceil(w / 28)  # LocateAnything's count
        stretched = [math.ceil(w / 28) * 28, math.ceil(h / 28) * 28]
        assert entry.get("stretched", [w, h]) == stretched and entry["resized"] == [w, h]
    shard = load_file(tmp_path / "export" / manifest[0]["shard"])
    assert shard["projected"].shape[1] == TEXT and shard["merged"].shape[1:] == (4, 64)

    summary = onnx_main(["--checkpoint", str(folder), "--out", str(tmp_path / "la.onnx"), "--projector"])
    if summary.get("check") is not None:
        assert summary["outputs"] == ["last_hidden_state", "merged", "projected"]
        assert max(summary["check"].values()) < 1e-4

    tree = tmp_path / "tree"
    for name in ("cat", "dog"):
        (tree / name).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (30, 20), (40 * i, 100 if name == "cat" else 0, 0)).save(tree / name / f"{i}.png")
    results = probe_main(["--checkpoint", str(folder), "--dataset", f"imagefolder:{tree}", "--out", str(tmp_path / "p"),
                          "--min-steps", "20", "--lrs", "0.1", "--weight-decays", "0", "--threads", "1",
                          "--short-side", "28", "--no-baseline"])  # fmt: skip
    assert 0.0 <= results["top1"] <= 1.0


def test_a_locateanything_tower_fine_tunes_resumes_and_loads_back(tmp_path):
    from test_train import TINY, kill_after_steps, train, weights

    model, projector = tiny_locateanything(dtype=torch.float32)
    folder = write_locateanything_folder(tmp_path / "la", model, projector)
    args = ["--objective", "supervised", "--checkpoint", folder, *TINY[4:], "--resolution", "28"]
    args += ["--batch-patches", "1024", "--steps", "6", "--save-every", "2", "--evals", "1"]
    train(*args, "--out", tmp_path / "straight")
    kill_after_steps(args, tmp_path / "killed", 3)
    train(*args, "--out", tmp_path / "killed")
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert any(not torch.equal(straight[k], v) for k, v in model.state_dict().items())  # it trained
    saved = tmp_path / "straight" / "checkpoint"
    assert MoonViT.from_pretrained(saved).config == model.config
    assert MoonViTImageProcessor.from_pretrained(saved) == MoonViTImageProcessor.locateanything()


def test_llama_cpp_export_refuses_mlp1_by_name():
    from moonvit.gguf import export_gguf

    model, projector = tiny_locateanything(dtype=torch.float32)
    with pytest.raises(ValueError, match="Kimi-VL / K2.5's projector .*this one is 'mlp1'"):
        export_gguf(model, projector, MoonViTImageProcessor.locateanything(), "unused.gguf", projector_type="kimivl")
