"""The commands on a classic ViT / DeiT folder: the main job, the export and the linear probe.

Each command runs in this process (its ``main(argv)``) on tiny towers and tiny images; what it
writes is checked against the tower called directly on the same pixels: bit for bit where it is
the same call on the same pack, else to float32's error across shapes (``ACROSS_SHAPES``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    assert_close_across_shapes,
    exported_rows,
    folder_bytes,
    noise_pngs,
    on_one_thread,
    run_export,
    tiny_model,
    with_threads,
)
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from moonvit import MoonViTImageProcessor, MoonViTOutput, VisionEncoder, encode_images
from moonvit.__main__ import main as moonvit_main
from moonvit.encode import checkpoint_processors, class_token_features
from moonvit.families.vit import ClassicViT
from moonvit.families.vit.processor import ClassicViTImageProcessor, NativeViTImageProcessor
from moonvit.model.interface import has_class_token, prefix_token_count
from moonvit.weights.storage import CheckpointError
from moonvit_eval.datasets import load_dataset
from moonvit_eval.encoder import load_frozen_encoder
from moonvit_eval.features import ResizePolicy, available_views, extract_features
from moonvit_eval.linear_probe import main as probe_main
from moonvit_eval.pictures import main as pictures_main
from moonvit_eval.pictures import resampled_table, stored_table
from moonvit_projector import MoonViTProjector, ProjectorConfig
from moonvit_projector.dataset import VisualTokenDataset
from moonvit_projector.export.cache import TokenCache, cache_settings

WIDTH = 64  # the vit-tiny preset's
PROCESSOR = NativeViTImageProcessor(patch_size=16, in_token_limit=256)
"""The native rule the test folders carry (their preprocessor_config.json): patch 16, no merger."""


def save_tower(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random vit-tiny tower (``overrides``: DeiT's tokens and heads, GAP) and the native processor."""
    torch.manual_seed(seed)
    ClassicViT.from_preset("vit-tiny", **overrides).save_pretrained(folder)
    PROCESSOR.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vit(tmp_path_factory) -> Path:
    return save_tower(tmp_path_factory.mktemp("vit"))


@pytest.fixture(scope="module")
def deit(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("deit")
    return save_tower(folder, 1, distillation_token=True, num_classes=5, distilled_head=True)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    """Five noise images: one of a whole patch grid, others padded to it, one under a patch."""
    return noise_pngs(tmp_path_factory.mktemp("images"))


def direct(folder: Path, sources: list) -> tuple[ClassicViT, MoonViTOutput, torch.Tensor]:
    """The tower of ``folder`` called on one pack of ``sources`` in order (the native rule's pixels),
    on one thread: (tower, output, grid_hws)."""
    tower = ClassicViT.from_pretrained(folder, dtype=torch.float32).eval()
    batch = PROCESSOR(sources)
    with torch.no_grad():
        output = on_one_thread(tower, batch.pixel_values, batch.grid_hws)
    return tower, output, batch.grid_hws


# ---- the interface --------------------------------------------------------------------------------


def test_both_towers_are_vision_encoders_and_say_their_prefix_tokens(vit, deit):
    tower = ClassicViT.from_pretrained(vit)
    distilled = ClassicViT.from_pretrained(deit)
    gap = ClassicViT.from_preset("vit-tiny", class_token=False, pool="avg")
    moon = tiny_model()
    for encoder in (tower, distilled, gap, moon):
        assert isinstance(encoder, VisionEncoder)
    assert [prefix_token_count(e.config) for e in (tower, distilled, gap, moon)] == [1, 2, 0, 0]
    assert [has_class_token(e.config) for e in (tower, distilled, gap, moon)] == [True, True, False, False]
    assert tower.config.merge_kernel_size == (1, 1) and tower.config.tokens_per_merge == 1


def test_a_vit_folder_is_read_at_native_resolution_with_its_patch_size(tmp_path):
    """The commands' rule for a classic ViT folder: the native one, at the tower's patch size and
    the folder's own normalisation (0.5 without a processor file, a DeiT file's ImageNet figures);
    a folder holding a native rule's file gives that file's settings (one of another patch size is
    refused); MoonViT's side limit mode is refused by name."""
    torch.manual_seed(0)
    ClassicViT.from_preset("vit-tiny", patch_size=8, image_size=32).save_pretrained(tmp_path)
    config = ClassicViT.from_pretrained(tmp_path).config
    bare = checkpoint_processors(tmp_path, config).image
    assert isinstance(bare, NativeViTImageProcessor) and bare.merge_kernel_size == (1, 1)
    assert (bare.patch_size, bare.image_mean, bare.image_std) == (8, (0.5,) * 3, (0.5,) * 3)
    imagenet = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "DeiTImageProcessor", "size": {"height": 36, "width": 36}, **imagenet})
    )
    native = checkpoint_processors(tmp_path, config).image
    assert isinstance(native, NativeViTImageProcessor) and native.patch_size == 8
    assert native.image_mean == tuple(imagenet["image_mean"]) and native.image_std == tuple(imagenet["image_std"])
    assert isinstance(checkpoint_processors(tmp_path, config, rule="deit").image, ClassicViTImageProcessor)
    with pytest.raises(CheckpointError, match="--side-limit-mode resize: a setting of MoonViT's processors"):
        checkpoint_processors(tmp_path, config, side_limit_mode="resize")
    own = NativeViTImageProcessor(patch_size=8, in_token_limit=128)
    own.save_pretrained(tmp_path)
    assert checkpoint_processors(tmp_path, config).image == own
    PROCESSOR.save_pretrained(tmp_path)  # 16 px patches for an 8 px tower: refused, not misread
    with pytest.raises(CheckpointError, match="cuts 16 px patches merged 1x1, its classic ViT / DeiT tower takes 8 px"):
        checkpoint_processors(tmp_path, config)


def test_encode_images_gives_each_image_its_prefix_rows_pooled_row_and_logits(deit, images):
    tower, output, grids = direct(deit, images)
    encoded = on_one_thread(encode_images, tower, PROCESSOR, images)
    counts = [h * w for h, w in grids.tolist()]
    for i, tokens in enumerate(encoded):
        assert tokens.shape == (counts[i], 1, WIDTH)
        assert encoded.prefix_tokens[i].shape == (2, WIDTH) and encoded.logits[i].shape == (5,)
    # one pack, the same call: the very same bits
    torch.testing.assert_close(torch.stack(encoded.prefix_tokens), output.prefix_tokens, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(encoded.pooled), output.pooled, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(encoded.logits), output.logits, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(list(encoded)), output.merged, rtol=0, atol=0)


# ---- python -m moonvit -------------------------------------------------------------------------


def test_main_job_writes_patch_tokens_and_the_cls_row_of_a_vit_folder(vit, images, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--checkpoint", str(vit), "--images", *map(str, images), "--out", str(out), "--dtype", "fp32"]
    with_threads(moonvit_main, [*args, "--threads", "1", "--save-checkpoint", str(tmp_path / "saved")])
    printed = capsys.readouterr().out
    assert "native rule: up to 256 patches of 16 px" in printed and "merged tokens (n, 1, D)" in printed
    _, output, grids = direct(vit, images)
    summary = json.loads((out / "summary.json").read_text())
    merged, pooled, prefix = (load_file(out / f"{name}.safetensors") for name in ("merged", "pooled", "prefix_tokens"))
    assert not (out / "logits.safetensors").exists()  # the tower has no head
    keys = [entry["image"] for entry in summary["images"]]
    rows = output.last_hidden_state.split([h * w for h, w in grids.tolist()])
    for i, (key, entry) in enumerate(zip(keys, summary["images"])):
        h, w = entry["grid_hw"]
        assert [h, w] == grids[i].tolist() and entry["num_tokens"] == h * w and entry["prefix_tokens"] == 1
        assert (
            merged[key].shape == (h * w, 1, WIDTH) and prefix[key].shape == (1, WIDTH) and pooled[key].shape == (WIDTH,)
        )
        torch.testing.assert_close(merged[key][:, 0], rows[i], rtol=0, atol=0)
        torch.testing.assert_close(pooled[key], output.pooled[i], rtol=0, atol=0)  # the same pack, the same call
        torch.testing.assert_close(prefix[key][0], output.prefix_tokens[i, 0], rtol=0, atol=0)
    # the saved folder is a classic ViT folder again, with the processor it ran
    assert ClassicViT.from_pretrained(tmp_path / "saved").config == ClassicViT.from_pretrained(vit).config
    assert checkpoint_processors(tmp_path / "saved", ClassicViT.from_pretrained(vit).config).image == PROCESSOR


def test_a_gap_tower_gives_the_mean_of_its_patch_rows_and_no_prefix_rows(tmp_path, images):
    """A classic ViT pooled by the mean of its patches (no CLS token): ``pooled`` is that mean, and
    neither the main job nor the export writes prefix rows; the export stores the pooled vector."""
    folder = save_tower(tmp_path / "gap", class_token=False, pool="avg")
    out = tmp_path / "out"
    argv = ["--checkpoint", str(folder), "--images", *map(str, images), "--out", str(out), "--dtype", "fp32"]
    with_threads(moonvit_main, [*argv, "--threads", "1"])
    assert sorted(p.name for p in out.iterdir()) == ["merged.safetensors", "pooled.safetensors", "summary.json"]
    merged, pooled = load_file(out / "merged.safetensors"), load_file(out / "pooled.safetensors")
    for key in merged:
        assert_close_across_shapes(pooled[key], merged[key][:, 0].mean(0))
    run_export("--inputs", images[0].parent, "--checkpoint", folder, "--out", tmp_path / "export", "--store", "merged")
    run = json.loads((tmp_path / "export" / "run.json").read_text())
    assert "prefix_tokens" not in run and run["pooled"]["kind"] == "mean"
    with safe_open(tmp_path / "export" / "shard-000000.safetensors", framework="pt") as shard:
        assert set(shard.keys()) == {"merged", "pooled"}


def test_main_job_on_a_transformers_classifier_writes_its_logits(tmp_path, capsys):
    """A transformers ViTForImageClassification folder: the logits equal transformers' own forward
    on the same 64x64 image (its native grid: no resampling) to float32's error."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=64, patch_size=16, num_labels=3,
    )  # fmt: skip
    reference = ViTForImageClassification(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    image = tmp_path / "square.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "out"
    argv = ["--checkpoint", str(tmp_path / "hf"), "--images", str(image), "--out", str(out), "--dtype", "fp32"]
    with_threads(moonvit_main, [*argv, "--threads", "1"])
    assert "logits (classes,)" in capsys.readouterr().out
    logits = load_file(out / "logits.safetensors")["square.png"]
    summary = json.loads((out / "summary.json").read_text())["images"][0]
    assert logits.shape == (3,) and summary["predicted_class"] == int(logits.argmax())
    pixels = torch.from_numpy(np.asarray(Image.open(image), dtype=np.float32)).permute(2, 0, 1) / 255
    with torch.no_grad():
        expected = reference(((pixels - 0.5) / 0.5)[None]).logits[0]
    assert_close_across_shapes(logits, expected)


def test_main_job_refuses_videos_for_a_vit_tower(vit, tmp_path, capsys):
    video = tmp_path / "clip.mp4"
    video.write_bytes(b"not decoded: refused before it is read")
    with pytest.raises(SystemExit):
        moonvit_main(["--checkpoint", str(vit), "--videos", str(video), "--out", str(tmp_path / "out")])
    assert "takes images only" in capsys.readouterr().err


# ---- python -m moonvit_projector.export --------------------------------------------------------


@pytest.mark.parametrize("tower", ["vit", "deit"])
def test_export_stores_patch_tokens_and_prefix_rows_equal_to_the_tower(tower, request, images, tmp_path):
    folder = request.getfixturevalue(tower)
    out = tmp_path / "out"
    args = ["--inputs", images[0].parent, "--checkpoint", folder, "--out", out, "--store", "merged", "--dtype", "fp32"]
    summary = run_export(*args, "--shard-size", "3")
    assert summary["images"] == len(images)
    count = 2 if tower == "deit" else 1
    run = json.loads((out / "run.json").read_text())
    assert run["store"] == ["merged"]
    assert run["prefix_tokens"] == {
        "tensor": "prefix_tokens",
        "count": count,
        "rows": ["cls", "distillation"][:count],
        "shape": ["images", count, WIDTH],
        "manifest_key": "prefix_row",
    }
    with safe_open(out / "shard-000000.safetensors", framework="pt") as shard:
        assert shard.get_slice("prefix_tokens").get_shape() == [3, count, WIDTH]
    _, output, grids = direct(folder, images)  # the export's one pack per shard: compared across shapes
    stored = exported_rows(out)
    patches = output.last_hidden_state.split([h * w for h, w in grids.tolist()])
    for i, path in enumerate(images):
        item = stored[path.name]
        assert item["merged"].shape == (patches[i].shape[0], 1, WIDTH) and item["prefix_tokens"].shape == (count, WIDTH)
        assert_close_across_shapes(item["prefix_tokens"], output.prefix_tokens[i])
        assert_close_across_shapes(item["prefix_tokens"][0], output.pooled[i])  # pooled is the CLS row
        assert_close_across_shapes(item["merged"][:, 0], patches[i])
    # the token reader reads the patch tokens as ever (the prefix rows are the manifest's to name)
    dataset = VisualTokenDataset(out)
    assert dataset.kinds == ("merged",) and dataset.by_id(images[0].name)["merged"].shape == (12, 1, WIDTH)


def test_exported_cls_rows_are_the_towers_bits_on_the_same_pack(vit, images, tmp_path):
    """One shard, one pack of every image in input order: the export's call is the direct one."""
    out = tmp_path / "out"
    run_export("--inputs", images[0].parent, "--checkpoint", vit, "--out", out, "--store", "merged", "--dtype", "fp32")
    _, output, _ = direct(vit, images)
    stored = exported_rows(out)
    exported = torch.stack([stored[path.name]["prefix_tokens"][0] for path in images])
    torch.testing.assert_close(exported, output.pooled, rtol=0, atol=0)


def test_export_cache_holds_the_prefix_rows_and_keys_them(vit, images, tmp_path):
    args = ["--inputs", images[0].parent, "--checkpoint", vit, "--store", "merged", "--cache", tmp_path / "cache"]
    run_export(*args, "--out", tmp_path / "first")
    second = run_export(*args, "--out", tmp_path / "second")
    assert second["cache_reused_this_run"] == len(images) and second["encoded_this_run"] == 0
    for name in ("shard-000000.safetensors", "manifest.jsonl"):
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes()
    run = json.loads((tmp_path / "first" / "run.json").read_text())
    settings = cache_settings(run)
    assert settings["prefix_tokens"] == run["prefix_tokens"]
    without = {key: value for key, value in run.items() if key != "prefix_tokens"}
    assert TokenCache(tmp_path, cache_settings(without)).digest != TokenCache(tmp_path, settings).digest
    entry = next((tmp_path / "cache").rglob("*.safetensors"))
    with safe_open(entry, framework="pt") as handle:
        assert set(handle.keys()) == {"merged", "prefix_tokens", "pooled"}
        assert handle.get_slice("prefix_tokens").get_shape() == [1, 1, WIDTH]
        assert handle.get_slice("pooled").get_shape() == [1, WIDTH]


def test_the_ray_engine_writes_a_vit_export_s_bytes(deit, images, tmp_path):
    """The prefix rows travel from Ray's encoder actors as the tokens do: the same folder, byte for byte."""
    pytest.importorskip("ray")
    args = ["--inputs", images[0].parent, "--checkpoint", deit, "--store", "merged", "--shard-size", "2"]
    run_export(*args, "--max-patches-per-pack", "16", "--out", tmp_path / "local")
    run_export(*args, "--max-patches-per-pack", "16", "--out", tmp_path / "ray", "--engine", "ray")
    assert folder_bytes(tmp_path / "ray") == folder_bytes(tmp_path / "local")
    assert len(exported_rows(tmp_path / "ray")) == len(images)


def test_a_moonvit_export_has_no_prefix_rows(tmp_path, images):
    folder = tmp_path / "moon"
    tiny_model().save_pretrained(folder)
    MoonViTImageProcessor(in_token_limit=64).save_pretrained(folder)
    run_export("--inputs", images[0].parent, "--checkpoint", folder, "--out", tmp_path / "out", "--store", "merged")
    assert "prefix_tokens" not in json.loads((tmp_path / "out" / "run.json").read_text())
    assert all("prefix_row" not in json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").open())
    with safe_open(tmp_path / "out" / "shard-000000.safetensors", framework="pt") as shard:
        assert set(shard.keys()) == {"merged"}


def export_error(capsys, *args) -> str:
    """The one line the export refuses ``args`` with (it exits 1, writing nothing)."""
    with pytest.raises(SystemExit) as exit_info:
        run_export(*args)
    assert exit_info.value.code == 1
    return capsys.readouterr().err


def test_projected_tokens_need_a_projector_for_one_patch_tokens(vit, images, tmp_path, capsys):
    inputs = ["--inputs", images[0].parent, "--checkpoint", vit]
    error = export_error(capsys, *inputs, "--out", tmp_path / "none")  # the default --store projected
    assert (
        "holds a classic ViT / DeiT tower, which comes without a projector: export its tokens with --store merged"
        in error
    )
    merging = tmp_path / "merging"
    MoonViTProjector(ProjectorConfig(vision_hidden_size=WIDTH, text_hidden_size=32)).save_pretrained(merging)
    error = export_error(capsys, *inputs, "--out", tmp_path / "bad", "--projector-from", merging)
    assert re.search(
        r"takes 64-wide patches merged 2x2, the encoder .* merged 1x1 \(a classic ViT / DeiT tower: no", error
    )
    error = export_error(capsys, *inputs, "--out", tmp_path / "vit", "--projector-from", vit)
    assert "(it holds a classic ViT / DeiT tower, which comes without a projector)" in error
    assert not any((tmp_path / name).exists() for name in ("none", "bad", "vit"))
    torch.manual_seed(2)
    per_patch = tmp_path / "per-patch"
    projector = MoonViTProjector(ProjectorConfig(vision_hidden_size=WIDTH, text_hidden_size=32, merge_kernel_size=1))
    projector.save_pretrained(per_patch)
    out = tmp_path / "out"
    run_export(*inputs, "--out", out, "--store", "both", "--projector-from", per_patch, "--dtype", "fp32")
    item = VisualTokenDataset(out).by_id(images[0].name)
    assert item["projected"].shape == (12, 32) and item["merged"].shape == (12, 1, WIDTH)
    with torch.no_grad():
        assert_close_across_shapes(item["projected"], projector.eval()(item["merged"]))


# ---- python -m moonvit_eval.linear_probe ------------------------------------------------------

PROBE = ["--dataset", "digits", "--short-side", "32", "--no-baseline", "--solver", "lbfgs", "--Cs", "1", "--no-logreg"]


@pytest.fixture(scope="module")
def digits_sample():
    return load_dataset("digits", seed=0).test.images[:24]


def test_probe_features_cls_mean_and_both_of_a_vit_tower(vit, digits_sample):
    encoder = load_frozen_encoder(checkpoint=vit, dtype=torch.float32)
    assert encoder.processor == PROCESSOR and available_views(encoder.model) == (
        "mean", "merged-mean", "cls", "both", "pooled",
    )  # fmt: skip
    resize = ResizePolicy(32)
    views = ["cls", "mean", "both"]
    features = on_one_thread(extract_features, encoder.model, encoder.processor, digits_sample, views, resize=resize)
    pictures = [resize(PROCESSOR.load_image(image)) for image in digits_sample]
    _, output, grids = direct(vit, pictures)  # one pack of the same images: the same call
    torch.testing.assert_close(features["cls"], output.prefix_tokens[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(features["cls"], class_token_features(output), rtol=0, atol=0)
    patch_means = torch.stack([rows.mean(0) for rows in output.last_hidden_state.split(grids.prod(1).tolist())])
    assert_close_across_shapes(features["mean"], patch_means)
    torch.testing.assert_close(features["both"], torch.cat([features["cls"], features["mean"]], 1), rtol=0, atol=0)


@pytest.mark.parametrize("view, dim", [("cls", WIDTH), ("mean", WIDTH), ("both", 2 * WIDTH)])
def test_linear_probe_command_on_a_vit_folder(view, dim, vit, tmp_path):
    argv = ["--checkpoint", str(vit), "--features", view, *PROBE, "--out", str(tmp_path / "out"), "--threads", "1"]
    results = with_threads(probe_main, argv)
    assert results["features"] == view and results["feature_dim"] == dim
    assert results["encoder"]["num_parameters"] == sum(p.numel() for p in ClassicViT.from_pretrained(vit).parameters())
    assert results["top1"] > 0.3  # a random tiny tower on 10 classes, well above chance


@pytest.mark.parametrize(
    "source, what", [("moonvit", "a MoonViT tower"), ("gap", "a classic ViT / DeiT tower pooled by the mean")]
)
@pytest.mark.parametrize("view", ["cls", "both"])
def test_cls_features_of_a_tower_without_a_cls_token_are_refused(source, what, view, tmp_path, capsys):
    folder = tmp_path / source
    if source == "moonvit":
        tiny_model().save_pretrained(folder)
    else:
        save_tower(folder, class_token=False, pool="avg")
    with pytest.raises(SystemExit):
        probe_main(["--checkpoint", str(folder), "--features", view, *PROBE, "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert f"--features {view} reads the CLS token, and this encoder ({what}" in error
    assert not (tmp_path / "out").exists()  # refused before any work


def test_position_pictures_of_a_vit_folder(vit, tmp_path):
    """``python -m moonvit_eval.pictures``: a classic ViT's stored table is its 1D table's patch rows
    on the native grid (the CLS row left out); ``--grid`` draws it resampled by the tower's rule."""
    tower = ClassicViT.from_pretrained(vit, dtype=torch.float32)
    side = tower.config.grid_side
    expected = tower.pos_embed[0, 1:].detach().reshape(side, side, WIDTH)
    torch.testing.assert_close(stored_table(tower), expected, rtol=0, atol=0)
    torch.testing.assert_close(resampled_table(tower, side, side), expected, rtol=0, atol=0)
    for extra in ([], ["--grid", "3", "5"]):
        out = tmp_path / f"picture{len(extra)}.png"
        pictures_main(["--checkpoint", str(vit), "--out", str(out), *extra])
        assert Image.open(out).size[0] > 0


# ---- the processor rule by name on every command ------------------------------------------------------


def test_image_rule_picks_the_checkpoint_s_fixed_resize_in_the_main_job_export_and_probe(vit, images, tmp_path):
    """``--image-rule vit``: every image resized to the checkpoint's 64 px (a 4 x 4 grid, 16 tokens), the
    rule recorded in run.json's processor (so another rule is another run); on a preset, refused by name."""
    out = tmp_path / "main"
    on_one_thread(moonvit_main, ["--checkpoint", str(vit), "--images", str(images[1]), "--image-rule", "vit",
                                 "--dtype", "fp32", "--out", str(out)])  # fmt: skip
    merged = load_file(out / "merged.safetensors")
    assert [tuple(t.shape) for t in merged.values()] == [(16, 1, 64)]

    export = tmp_path / "export"
    run_export("--inputs", images[0].parent, "--checkpoint", vit, "--out", export, "--store", "merged",
               "--image-rule", "vit", "--dtype", "fp32")  # fmt: skip
    run = json.loads((export / "run.json").read_text())
    assert run["processor"]["rule"] == "vit" and run["arguments"]["image_rule"] == "vit"
    lines = [json.loads(line) for line in (export / "manifest.jsonl").read_text().splitlines()]
    assert {line["num_tokens"] for line in lines} == {16}

    encoder = load_frozen_encoder(checkpoint=vit, image_rule="deit")
    assert isinstance(encoder.processor, ClassicViTImageProcessor) and encoder.processor.rule == "deit"
    with pytest.raises(ValueError, match="image rule 'vit': a checkpoint's processor rule"):
        load_frozen_encoder(preset="tiny", random_init=True, image_rule="vit")
    with pytest.raises(SystemExit):
        moonvit_main(["--preset", "tiny", "--image-rule", "vit", "--out", str(tmp_path / "preset")])
    with pytest.raises(CheckpointError, match="unknown processor rule 'bogus'"):
        checkpoint_processors(vit, ClassicViT.from_pretrained(vit).config, rule="bogus")
