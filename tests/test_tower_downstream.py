"""The commands on the towers VLA stacks load: a SigLIP-like ViT tower (no prefix tokens, a MAP head)
and a DINOv2-like one (CLS and registers, LayerScale), through the main job, the export and the probe;
DINOv2's linear-evaluation features against transformers' ``Dinov2WithRegistersModel``; the family hook.

The towers are the ViT tower's configs saved in this package's own format (tiny, random weights, 4
blocks for DINOv2's last four); the DINOv2 reference a transformers folder read by the dinov2 family.
What a command writes is checked against the tower called directly on the same pixels: bit for bit
where it is the same call on the same pack, else to float32's error across shapes (``ACROSS_SHAPES``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    assert_close_across_shapes,
    exported_rows,
    noise_pngs,
    on_one_thread,
    randomise_,
    run_export,
    tiny_model,
    with_threads,
)
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

from moonvit import MoonViTOutput
from moonvit.__main__ import main as moonvit_main
from moonvit.encode import checkpoint_processors
from moonvit.families import Family, family_named, family_of
from moonvit.families.vit import ClassicViT, ClassicViTConfig
from moonvit.families.vit.processor import NativeViTImageProcessor
from moonvit.media.processor import unpatchify
from moonvit.model.config import preset_config
from moonvit.model.interface import pooled_kind, prefix_token_names, tower_name
from moonvit_eval.encoder import load_frozen_encoder
from moonvit_eval.features import ResizePolicy, available_views, extract_features
from moonvit_eval.linear_probe import main as probe_main

WIDTH = 64
PROCESSOR = NativeViTImageProcessor(patch_size=16, in_token_limit=256)
SIGLIP = dict(class_token=False, pool="map", hidden_act="gelu_tanh", layer_norm_eps=1e-6)
DINOV2 = dict(num_register_tokens=2, layer_scale=True, no_embed_class=True, num_hidden_layers=4, layer_norm_eps=1e-6)


def save_tower(folder: Path, seed: int = 0, **overrides) -> Path:
    """A randomised vit-tiny tower with ``overrides`` in this package's format, with the native processor."""
    tower = randomise_(ClassicViT.from_preset("vit-tiny", **overrides), seed, std=0.1)
    tower.save_pretrained(folder)
    PROCESSOR.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def siglip(tmp_path_factory) -> Path:
    return save_tower(tmp_path_factory.mktemp("siglip"), **SIGLIP)


@pytest.fixture(scope="module")
def dinov2(tmp_path_factory) -> Path:
    return save_tower(tmp_path_factory.mktemp("dinov2"), 1, **DINOV2)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    """Five noise images: one of a whole patch grid, others resized to one, one under a patch."""
    return noise_pngs(tmp_path_factory.mktemp("images"))


def direct(folder: Path, sources: list) -> tuple[MoonViTOutput, torch.Tensor]:
    """The tower of ``folder`` called on one pack of ``sources`` in order, on one thread: (output, grid_hws)."""
    tower = ClassicViT.from_pretrained(folder, dtype=torch.float32).eval()
    batch = PROCESSOR(sources)
    with torch.no_grad():
        return on_one_thread(tower, batch.pixel_values, batch.grid_hws), batch.grid_hws


# ---- python -m moonvit -------------------------------------------------------------------------------


def run_main(folder: Path, images: list[Path], out: Path) -> dict:
    argv = ["--checkpoint", str(folder), "--images", *map(str, images), "--out", str(out), "--dtype", "fp32"]
    with_threads(moonvit_main, [*argv, "--threads", "1"])
    return json.loads((out / "summary.json").read_text())


def test_main_job_on_a_siglip_like_tower_writes_its_map_vector_and_no_prefix_file(siglip, images, tmp_path):
    """No prefix tokens: no prefix_tokens file (as a GAP tower); ``pooled`` is the MAP head's output, the
    tower's own bits (one pack, the same call); summary.json says so."""
    out = tmp_path / "out"
    summary = run_main(siglip, images, out)
    assert sorted(p.name for p in out.iterdir()) == ["merged.safetensors", "pooled.safetensors", "summary.json"]
    assert summary["pooled"] == "map" and summary["prefix_tokens"] == []
    output, grids = direct(siglip, images)
    merged, pooled = load_file(out / "merged.safetensors"), load_file(out / "pooled.safetensors")
    rows = output.last_hidden_state.split(grids.prod(1).tolist())
    for i, entry in enumerate(summary["images"]):
        key = entry["image"]
        assert entry["prefix_tokens"] == 0 and pooled[key].shape == (WIDTH,)
        torch.testing.assert_close(pooled[key], output.pooled[i], rtol=0, atol=0)
        torch.testing.assert_close(merged[key][:, 0], rows[i], rtol=0, atol=0)
    assert not torch.allclose(pooled[summary["images"][0]["image"]], rows[0].mean(0), atol=1e-3)  # not a mean


def test_main_job_on_a_dinov2_like_tower_writes_cls_and_registers(dinov2, images, tmp_path):
    out = tmp_path / "out"
    summary = run_main(dinov2, images, out)
    assert summary["pooled"] == "cls" and summary["prefix_tokens"] == ["cls", "register_0", "register_1"]
    output, _ = direct(dinov2, images)
    prefix, pooled = load_file(out / "prefix_tokens.safetensors"), load_file(out / "pooled.safetensors")
    for i, entry in enumerate(summary["images"]):
        key = entry["image"]
        assert entry["prefix_tokens"] == 3 and prefix[key].shape == (3, WIDTH)
        torch.testing.assert_close(prefix[key], output.prefix_tokens[i], rtol=0, atol=0)
        torch.testing.assert_close(pooled[key], prefix[key][0], rtol=0, atol=0)  # DINOv2's pooled: the CLS row


# ---- python -m moonvit_projector.export --------------------------------------------------------------


def test_export_of_a_siglip_like_tower_stores_the_map_vector_per_image(siglip, images, tmp_path):
    out = tmp_path / "out"
    run_export(
        "--inputs", images[0].parent, "--checkpoint", siglip, "--out", out, "--store", "merged", "--dtype", "fp32"
    )
    run = json.loads((out / "run.json").read_text())
    assert "prefix_tokens" not in run
    assert run["pooled"] == {
        "tensor": "pooled",
        "kind": "map",
        "shape": ["images", WIDTH],
        "manifest_key": "pooled_row",
    }
    with safe_open(out / "shard-000000.safetensors", framework="pt") as shard:
        assert set(shard.keys()) == {"merged", "pooled"} and shard.get_slice("pooled").get_shape() == [5, WIDTH]
    output, _ = direct(siglip, images)  # one shard, one pack of every image in input order: the same call
    stored = exported_rows(out)
    assert all("prefix_tokens" not in item for item in stored.values())
    torch.testing.assert_close(torch.stack([stored[p.name]["pooled"] for p in images]), output.pooled, rtol=0, atol=0)


def test_export_of_a_dinov2_like_tower_stores_cls_registers_and_pooled(dinov2, images, tmp_path):
    """Shards of 2 images (other packs than the direct call: compared across shapes)."""
    out = tmp_path / "out"
    args = ["--inputs", images[0].parent, "--checkpoint", dinov2, "--out", out, "--store", "merged", "--dtype", "fp32"]
    run_export(*args, "--shard-size", "2")
    run = json.loads((out / "run.json").read_text())
    assert run["prefix_tokens"] == {
        "tensor": "prefix_tokens",
        "count": 3,
        "rows": ["cls", "register_0", "register_1"],
        "shape": ["images", 3, WIDTH],
        "manifest_key": "prefix_row",
    }
    assert run["pooled"]["kind"] == "cls"
    output, grids = direct(dinov2, images)
    patches = output.last_hidden_state.split(grids.prod(1).tolist())
    stored = exported_rows(out)
    for i, path in enumerate(images):
        item = stored[path.name]
        assert item["prefix_tokens"].shape == (3, WIDTH) and item["pooled"].shape == (WIDTH,)
        assert torch.equal(item["pooled"], item["prefix_tokens"][0])
        assert_close_across_shapes(item["prefix_tokens"], output.prefix_tokens[i])
        assert_close_across_shapes(item["merged"][:, 0], patches[i])


# ---- python -m moonvit_eval.linear_probe ---------------------------------------------------------------

PROBE = ["--dataset", "digits", "--short-side", "32", "--no-baseline", "--solver", "lbfgs", "--Cs", "1", "--no-logreg"]


@pytest.fixture(scope="module")
def digits_sample():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in [(32, 32), (24, 40), (48, 20), (16, 16)]]


@pytest.mark.parametrize("tower", ["siglip", "dinov2"])
def test_pooled_view_is_the_tower_s_pooled_output(tower, request, digits_sample):
    folder = request.getfixturevalue(tower)
    encoder = load_frozen_encoder(checkpoint=folder, dtype=torch.float32)
    assert "pooled" in available_views(encoder.model)
    resize = ResizePolicy(32)
    features = on_one_thread(
        extract_features, encoder.model, encoder.processor, digits_sample, ["pooled"], resize=resize
    )
    output, _ = direct(folder, [resize(PROCESSOR.load_image(image)) for image in digits_sample])  # the same call
    torch.testing.assert_close(features["pooled"], output.pooled, rtol=0, atol=0)


def test_views_a_siglip_like_tower_gives_and_refuses(siglip, tmp_path, capsys):
    encoder = load_frozen_encoder(checkpoint=siglip)
    assert available_views(encoder.model) == ("mean", "merged-mean", "pooled")
    with pytest.raises(SystemExit):
        probe_main(["--checkpoint", str(siglip), "--features", "cls", *PROBE, "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert (
        "--features cls reads the CLS token, and this encoder (a classic ViT / DeiT tower pooled by its MAP " in error
    )


def test_pooled_features_of_a_moonvit_tower_are_refused(tmp_path, capsys):
    tiny_model().save_pretrained(tmp_path / "moon")
    with pytest.raises(SystemExit):
        probe_main(
            ["--checkpoint", str(tmp_path / "moon"), "--features", "pooled", *PROBE, "--out", str(tmp_path / "o")]
        )
    error = capsys.readouterr().err
    assert "--features pooled reads the tower's pooled output, and this encoder (a MoonViT tower) gives none" in error
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--features", "mean", "--last-blocks", "2"], "--last-blocks 2 reads the CLS rows of the last blocks: it goes "
         "with --features cls or both, not mean"),
        (["--features", "both", "--last-blocks", "5"], "--last-blocks 5 reads the CLS rows of the last 5 blocks; this "
         "encoder has 4"),
    ],
)  # fmt: skip
def test_last_blocks_refusals_name_the_flag(extra, message, dinov2, tmp_path, capsys):
    with pytest.raises(SystemExit):
        probe_main(["--checkpoint", str(dinov2), *extra, *PROBE, "--out", str(tmp_path / "out")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_linear_probe_command_with_dinov2_s_linear_evaluation_features(dinov2, tmp_path):
    argv = ["--checkpoint", str(dinov2), "--features", "both", "--last-blocks", "4", *PROBE, "--threads", "1"]
    results = with_threads(probe_main, [*argv, "--out", str(tmp_path / "out")])
    assert results["features"] == "both-last4" and results["feature_dim"] == 5 * WIDTH
    assert (tmp_path / "out" / "confusion_both-last4.png").is_file()
    assert results["top1"] > 0.3  # a random tiny tower on 10 classes, well above chance
    pooled = with_threads(probe_main, ["--checkpoint", str(dinov2), "--features", "pooled", *PROBE, "--threads", "1",
                                       "--out", str(tmp_path / "pooled")])  # fmt: skip
    assert pooled["features"] == "pooled" and pooled["feature_dim"] == WIDTH


# ---- DINOv2's linear evaluation against transformers ------------------------------------------------------


def test_last_blocks_features_are_dinov2_s_linear_evaluation_of_transformers_model(tmp_path, digits_sample):
    """``cls-last4`` / ``both-last4`` as DINOv2's ``create_linear_input(n_last_blocks=4, avgpool=True)``
    computes them from ``get_intermediate_layers(n=4, return_class_token=True, norm=True)``: the CLS rows
    of the last 4 blocks, each through the final layernorm, then the mean of the last block's normed
    patch rows (registers left out), here from transformers' ``Dinov2WithRegistersModel``'s hidden
    states, image by image, on the pixels the probe's processor gave. Float64: within 1e-5, transformers'
    table resampled in float32 (grids other than its native 4 x 4)."""
    config = Dinov2WithRegistersConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, mlp_ratio=2, image_size=32, patch_size=8,
        num_register_tokens=2,
    )  # fmt: skip
    reference = randomise_(Dinov2WithRegistersModel(config).double(), seed=5)
    reference.set_attn_implementation("sdpa")
    reference.eval().save_pretrained(tmp_path)
    encoder = load_frozen_encoder(checkpoint=tmp_path, dtype=torch.float64)
    resize = ResizePolicy(0)
    views = ["cls-last4", "both-last4", "cls", "both"]
    features = on_one_thread(extract_features, encoder.model, encoder.processor, digits_sample, views, resize=resize)
    batch = encoder.processor([encoder.processor.load_image(image) for image in digits_sample])
    pictures = [unpatchify(p, hw) for p, hw in zip(batch.pixel_values.split(batch.grid_hws.prod(1).tolist()),
                                                     batch.grid_hws.tolist())]  # fmt: skip
    rows = []
    with torch.no_grad():
        for picture in pictures:
            hidden = reference(pixel_values=picture[None].double(), output_hidden_states=True).hidden_states
            normed = [reference.layernorm(h[0]) for h in hidden[-4:]]
            rows.append(torch.cat([*(n[0] for n in normed), normed[-1][3:].mean(0)]))
    expected = torch.stack(rows).float()
    close = dict(rtol=0.0, atol=1e-5)
    assert features["both-last4"].shape == (len(digits_sample), 5 * 32)
    torch.testing.assert_close(features["both-last4"], expected, **close)
    torch.testing.assert_close(features["cls-last4"], expected[:, : 4 * 32], **close)
    torch.testing.assert_close(features["cls"], features["cls-last4"][:, 3 * 32 :], rtol=0, atol=0)
    torch.testing.assert_close(features["both"], torch.cat([features["cls"], expected[:, 4 * 32 :]], 1), **close)


# ---- the family hook ---------------------------------------------------------------------------------------


def test_a_tower_s_family_names_its_default_rule_and_its_name(tmp_path):
    """family_of: a ViT tower's config by its ``family`` field, MoonViT's by its class; the classic ViT's
    spec reads its folders natively by default, a MoonViT folder by its own files; pooled_kind and
    prefix_token_names read the config."""
    vit = ClassicViTConfig(**SIGLIP)
    assert family_of(vit) is family_named("classic-vit")
    assert family_of(preset_config("tiny")).tower_name == "MoonViT tower"  # every MoonViT family's
    assert family_of(vit).default_rule == "native" and tower_name(vit) == "classic ViT / DeiT tower"
    assert family_of(ClassicViTConfig(family="dinov2")) is family_named("dinov2")
    with pytest.raises(ValueError, match="no checkpoint family 'nope'"):
        family_of(ClassicViTConfig(family="nope"))
    assert family_of(object()) is None and tower_name(object()) == "vision tower"  # type: ignore[arg-type]
    assert (pooled_kind(vit), prefix_token_names(vit)) == ("map", ())
    dino = ClassicViTConfig(**DINOV2)
    assert (pooled_kind(dino), prefix_token_names(dino)) == ("cls", ("cls", "register_0", "register_1"))
    assert pooled_kind(preset_config("tiny")) is None
    deit = ClassicViTConfig(distillation_token=True)
    assert prefix_token_names(deit) == ("cls", "distillation")
    with pytest.raises(ValueError, match="default_rule 'bogus' is not one of its processor rules"):
        Family("x", ClassicViTConfig, bool, lambda *a: (None, None), ClassicViT, ("native",), default_rule="bogus")


def test_a_dinov2_transformers_folder_is_read_natively_with_its_normalisation(tmp_path):
    config = Dinov2WithRegistersConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                                       patch_size=8, num_register_tokens=2)  # fmt: skip
    Dinov2WithRegistersModel(config).save_pretrained(tmp_path)
    tower = ClassicViT.from_pretrained(tmp_path)
    image = checkpoint_processors(tmp_path, tower.config).image
    assert isinstance(image, NativeViTImageProcessor) and image.patch_size == 8
    assert image.image_mean == pytest.approx((0.485, 0.456, 0.406))
    assert checkpoint_processors(tmp_path, tower.config, rule="dinov2").image.to_dict()["rule"] == "dinov2"


def test_a_processor_whose_patches_the_tower_does_not_take_is_refused(tmp_path):
    """A folder's processor cutting other patches than its tower takes is a CheckpointError naming both,
    never features of misread pixels: a MoonViT folder with a 16 px processor for its 14 px tower."""
    from moonvit import CheckpointError, MoonViTImageProcessor

    model = tiny_model()
    model.save_pretrained(tmp_path)
    MoonViTImageProcessor(patch_size=16).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="cuts 16 px patches merged 2x2, its MoonViT tower takes 14 px patches"):
        checkpoint_processors(tmp_path, model.config)


def test_a_siglip_folder_gets_its_family_s_processor_or_a_named_refusal(tmp_path):
    """A transformers SigLIP folder is the siglip family's (its config says so): the commands read it by
    that family's processor, one of the tower's patch size, or refuse it by name; never MoonViT's."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from moonvit import CheckpointError

    config = SiglipVisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    SiglipVisionModel(config).save_pretrained(tmp_path)
    tower = ClassicViT.from_pretrained(tmp_path)
    assert family_of(tower.config) is family_named("siglip") and pooled_kind(tower.config) == "map"
    try:
        image = checkpoint_processors(tmp_path, tower.config).image
    except CheckpointError as error:
        assert "its SigLIP tower takes 8 px patches merged 1x1" in str(error)
    else:
        assert (image.patch_size, image.merge_kernel_size) == (8, (1, 1))


# ---- transformers' SigLIP, SigLIP2 and DINOv2 folders through the commands -----------------------------


def transformers_folder(kind: str, folder: Path) -> Path:
    """A tiny random transformers vision folder: SiglipVisionModel, Siglip2VisionModel or
    Dinov2WithRegistersModel (patch 8, a 32 px table)."""
    from transformers import Siglip2VisionConfig, Siglip2VisionModel, SiglipVisionConfig, SiglipVisionModel

    size = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=8)
    torch.manual_seed(0)
    if kind == "siglip":
        model = SiglipVisionModel(SiglipVisionConfig(**size, intermediate_size=64, image_size=32))
    elif kind == "siglip2":
        model = Siglip2VisionModel(Siglip2VisionConfig(**size, intermediate_size=64, num_patches=16))
    else:
        model = Dinov2WithRegistersModel(Dinov2WithRegistersConfig(**size, image_size=32, num_register_tokens=2))
    randomise_(model, seed=2, std=0.1).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "kind, rule, pooled, prefix",
    [("siglip", "native", "map", []), ("siglip2", "naflex", "map", []), ("dinov2", "native", "cls", 3)],
)
def test_main_job_and_export_on_transformers_folders(kind, rule, pooled, prefix, images, tmp_path):
    """Each family's default rule reads the folder (native resolution; SigLIP2's own NaFlex rule); the main
    job writes the tower's pooled vector (and prefix rows where it has them) as the tower gives them on the
    same pack; the export stores the same rows (one shard, one pack: the same call)."""
    folder = transformers_folder(kind, tmp_path / kind)
    tower = ClassicViT.from_pretrained(folder, dtype=torch.float32).eval()
    processor = checkpoint_processors(folder, tower.config).image
    assert type(processor).__name__ == {"native": "NativeViTImageProcessor", "naflex": "NaFlexImageProcessor"}[rule]
    assert processor.patch_size == 8 and processor.merge_kernel_size == (1, 1)
    out = tmp_path / "out"
    summary = run_main(folder, images, out)
    assert summary["pooled"] == pooled and len(summary["prefix_tokens"]) == (prefix or 0)
    batch = processor(images)
    with torch.no_grad():
        direct_out = on_one_thread(tower, batch.pixel_values, batch.grid_hws)
    written = load_file(out / "pooled.safetensors")
    keys = [entry["image"] for entry in summary["images"]]
    torch.testing.assert_close(torch.stack([written[k] for k in keys]), direct_out.pooled, rtol=0, atol=0)
    assert (out / "prefix_tokens.safetensors").exists() == bool(prefix)
    export = tmp_path / "export"
    run_export("--inputs", images[0].parent, "--checkpoint", folder, "--out", export, "--store", "merged",
               "--dtype", "fp32")  # fmt: skip
    stored = exported_rows(export)
    torch.testing.assert_close(
        torch.stack([stored[p.name]["pooled"] for p in images]), direct_out.pooled, rtol=0, atol=0
    )
    if prefix:
        exported_prefix = torch.stack([stored[p.name]["prefix_tokens"] for p in images])
        torch.testing.assert_close(exported_prefix, direct_out.prefix_tokens, rtol=0, atol=0)
