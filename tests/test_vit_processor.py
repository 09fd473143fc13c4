"""The classic ViT / DeiT processors (moonvit.families.vit.processor) and choosing one by name.

The fixed rules are pinned, pixel for pixel (``torch.equal`` in float32), against transformers'
PIL-backend processors, built from the ``preprocessor_config.json`` that transformers'
``save_pretrained`` writes; timm's rule against a plain reference written from timm's evaluation
transform (timm is not a dependency). The native rule against its stated properties.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import noise_image, our_image, their_image
from PIL import Image
from reference_vit import timm_eval_transform

from moonvit import MoonViTImageProcessor, encode_images, pack_images
from moonvit.families.vit import ClassicViT, classic_vit_config
from moonvit.families.vit.processor import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ClassicViTImageProcessor,
    NativeViTImageProcessor,
    processor_for_config,
)
from moonvit.media import ImageSizeError, MoonViTVideoProcessor, processor_for
from moonvit.media.presets import describe_processors
from moonvit.weights.storage import CheckpointError

transformers = pytest.importorskip("transformers")

# Sizes (height, width): a pixel, tiny and odd, the native size, non-square both ways, very thin, large.
SIZES = [(1, 1), (3, 5), (17, 9), (224, 224), (255, 257), (300, 199), (97, 1303), (1537, 2001)]
SMALL = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128)


def _saved(folder: Path, processor: Any, config: Any) -> Path:
    """A transformers folder: its config.json and the processor's preprocessor_config.json."""
    config.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


# ---- the fixed rules against transformers ------------------------------------------------------

# transformers' processors as the releases configure them, and variants that reach every branch of
# the rule: a shorter-side resize (odd crop offsets), a crop larger than the resize (padding),
# another size and filter without the rescale, no normalisation, a non-square size with scalar mean / std.
TRANSFORMERS_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "vit": ("ViTImageProcessorPil", {}),
    "deit": ("DeiTImageProcessorPil", {"image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD)}),
    "deit-shortest-edge": ("DeiTImageProcessorPil", {"size": {"shortest_edge": 256}}),
    "deit-crop-past-edges": (
        "DeiTImageProcessorPil",
        {"size": {"height": 200, "width": 208}, "crop_size": {"height": 224, "width": 224}},
    ),
    "vit-384-bicubic-unscaled": (
        "ViTImageProcessorPil",
        {"size": {"height": 384, "width": 384}, "resample": 3, "do_rescale": False},
    ),
    "vit-unnormalised": ("ViTImageProcessorPil", {"do_normalize": False}),
    "vit-rect-lanczos": (
        "ViTImageProcessorPil",
        {"size": {"height": 160, "width": 320}, "resample": 1, "image_mean": 0.3, "image_std": 0.2},
    ),
}


@pytest.mark.parametrize("case", sorted(TRANSFORMERS_CASES))
def test_fixed_rules_equal_transformers_pixel_for_pixel(case: str, tmp_path: Path) -> None:
    class_name, kwargs = TRANSFORMERS_CASES[case]
    theirs = getattr(transformers, class_name)(**kwargs)
    config = (transformers.DeiTConfig if "Dei" in class_name else transformers.ViTConfig)(**SMALL)
    ours = processor_for(_saved(tmp_path, theirs, config))  # read from the file save_pretrained wrote
    assert isinstance(ours, ClassicViTImageProcessor)
    for height, width in SIZES:
        image = noise_image(height, width)
        expected, got = their_image(theirs, image), our_image(ours, image)
        assert expected.dtype == got.dtype == torch.float32
        assert got.shape == expected.shape, (case, height, width)
        assert torch.equal(got, expected), (case, height, width, (got - expected).abs().max().item())


def test_release_files_of_the_older_form_read_as_transformers_reads_them(tmp_path: Path) -> None:
    """The hub's ViT and DeiT releases ship ``feature_extractor_type`` files with int sizes."""
    files = {
        "vit": {"do_normalize": True, "do_resize": True, "feature_extractor_type": "ViTFeatureExtractor",
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 224},
        "deit": {"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
                 "feature_extractor_type": "DeiTFeatureExtractor", "image_mean": list(IMAGENET_MEAN),
                 "image_std": list(IMAGENET_STD), "resample": 3, "size": 256},
    }  # fmt: skip
    for kind, values in files.items():
        folder = tmp_path / kind
        (transformers.DeiTConfig if kind == "deit" else transformers.ViTConfig)(**SMALL).save_pretrained(folder)
        (folder / "preprocessor_config.json").write_text(json.dumps(values))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers: no torchvision, its PIL backend is taken
            theirs = transformers.AutoImageProcessor.from_pretrained(folder)
        ours = processor_for(folder)
        assert isinstance(ours, ClassicViTImageProcessor) and ours.rule == kind
        for height, width in [(5, 3), (300, 199), (97, 1303)]:
            image = noise_image(height, width)
            assert torch.equal(our_image(ours, image), their_image(theirs, image)), (kind, height, width)


# ---- timm's rule -------------------------------------------------------------------------------


def _timm_folder(folder: Path, **pretrained: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architecture": "vit_base_patch16_224.augreg2_in21k_ft_in1k", "num_classes": 1000,
           "num_features": 768, "global_pool": "token", "pretrained_cfg": pretrained}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_timm_rule_equals_its_evaluation_transform(tmp_path: Path) -> None:
    folder = _timm_folder(tmp_path, input_size=[3, 224, 224], interpolation="bicubic", crop_pct=0.9,
                          crop_mode="center", mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])  # fmt: skip
    ours = processor_for(folder)
    assert isinstance(ours, ClassicViTImageProcessor)
    assert (ours.rule, ours.shortest_edge, ours.crop_size, ours.crop_offset) == ("timm", 248, (224, 224), "round")
    for height, width in SIZES:
        image = noise_image(height, width)
        expected = timm_eval_transform(image, 224, 0.9, Image.Resampling.BICUBIC, (0.5,) * 3, (0.5,) * 3)
        assert torch.equal(our_image(ours, image), expected), (height, width)
    # timm's defaults where pretrained_cfg is silent: 224 px, bicubic, crop_pct 0.875, ImageNet's statistics
    defaults = processor_for(_timm_folder(tmp_path / "defaults"))
    assert isinstance(defaults, ClassicViTImageProcessor)
    assert (defaults.shortest_edge, defaults.resample, defaults.image_mean) == (256, 3, IMAGENET_MEAN)
    image = noise_image(199, 301)
    expected = timm_eval_transform(image, 224, 0.875, Image.Resampling.BICUBIC, IMAGENET_MEAN, IMAGENET_STD)
    assert torch.equal(our_image(defaults, image), expected)


def test_timm_squash_mode_resizes_both_sides(tmp_path: Path) -> None:
    ours = processor_for(_timm_folder(tmp_path, crop_pct=0.9, crop_mode="squash", interpolation="bilinear"))
    assert isinstance(ours, ClassicViTImageProcessor)
    assert (ours.size, ours.crop_size, ours.resample) == ((248, 248), (224, 224), 2)
    plan = ours.plan_image(640, 480)
    assert plan.resized_size == (248, 248) and plan.box == (12, 12, 236, 236) and plan.grid_hw == (14, 14)


def test_crop_offsets_floor_for_transformers_and_round_half_even_for_timm() -> None:
    # a 301x199 image: the shorter side to 256 gives 387 x 256 px, (387 - 224) / 2 = 81.5
    floor = ClassicViTImageProcessor(rule="deit", size=None, shortest_edge=256, crop_size=(224, 224))
    rounded = ClassicViTImageProcessor(
        rule="timm", size=None, shortest_edge=256, crop_size=(224, 224), crop_offset="round"
    )
    assert floor.plan_image(301, 199).box[0] == 81 and rounded.plan_image(301, 199).box[0] == 82
    assert rounded.plan_image(299, 199).box[0] == 80  # 80.5: halves to even, as Python's round


# ---- the native rule ---------------------------------------------------------------------------


def _native_sizes() -> list[tuple[int, int]]:
    rng = np.random.default_rng(3)
    sizes = [(1, 1), (15, 17), (16, 16), (224, 224), (448, 448), (449, 447), (1, 5000), (5000, 3), (100000, 1)]
    sizes += [(int(w), int(h)) for w, h in rng.integers(1, 4000, (300, 2))]
    return sizes


@pytest.mark.parametrize("budget", [1, 7, 196, 784, 4096])
def test_native_sides_are_whole_patches_within_the_budget_aspect_kept(budget: int) -> None:
    processor = NativeViTImageProcessor(in_token_limit=budget, patch_limit_on_one_side=512)
    p = processor.patch_size
    for width, height in _native_sizes():
        plan = processor.plan_image(width, height)
        rows, cols = plan.grid_hw
        assert plan.resized_size == (cols * p, rows * p) and plan.box == (0, 0, cols * p, rows * p)
        assert 1 <= rows * cols <= budget, (width, height, budget, plan)
        assert rows <= 512 and cols <= 512
        # each side within one patch of the image's side scaled to the budget (never up), unless held
        # at one patch or at the side cap (very thin images)
        scale = min(1.0, math.sqrt(budget * p * p / (width * height)))
        if 1 < rows < 512 and 1 < cols < 512:
            assert abs(rows - height * scale / p) < 1 and abs(cols - width * scale / p) < 1, (width, height, plan)


def test_native_leaves_images_on_whole_patches_unresized_and_scales_down_only() -> None:
    processor = NativeViTImageProcessor(in_token_limit=784)
    assert processor.plan_image(224, 224).resized_size == (224, 224)
    assert processor.plan_image(448, 320).grid_hw == (20, 28)
    assert processor.plan_image(64, 32).grid_hw == (2, 4)  # small images stay small
    assert processor.plan_image(4000, 3000).grid_hw == (24, 32)  # 768 patches, 4:3
    assert processor.plan_image(4000, 3000, in_token_limit=48).grid_hw == (6, 8)
    # a 224 x 224 image: the native rule's pixels are the ViT rule's (no resize either way)
    image = noise_image(224, 224)
    assert torch.equal(our_image(processor, image), our_image(ClassicViTImageProcessor(), image))


def test_native_pixels_are_one_pillow_resize_then_the_normalisation() -> None:
    processor = NativeViTImageProcessor(
        in_token_limit=100, resample=2, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD
    )
    image = noise_image(301, 199)
    plan = processor.plan_image(*image.size)
    resized = np.array(image.resize(plan.resized_size, Image.Resampling.BILINEAR)).astype(np.float64) / 255
    mean, std = np.array(IMAGENET_MEAN, np.float32), np.array(IMAGENET_STD, np.float32)
    expected = (resized.astype(np.float32) - mean) / std
    got = our_image(processor, image)
    assert torch.equal(got, torch.from_numpy(expected).permute(2, 0, 1))


# ---- by name -----------------------------------------------------------------------------------


def test_rules_by_name_for_a_config() -> None:
    config = classic_vit_config("vit-base-16")
    vit, deit, native = (processor_for_config(config, rule) for rule in ("vit", "deit", "native"))
    assert isinstance(vit, ClassicViTImageProcessor) and isinstance(deit, ClassicViTImageProcessor)
    assert (vit.size, vit.crop_size, vit.resample, vit.image_mean) == ((224, 224), None, 2, (0.5,) * 3)
    assert (deit.size, deit.crop_size, deit.resample, deit.image_mean) == ((256, 256), (224, 224), 3, IMAGENET_MEAN)
    assert isinstance(native, NativeViTImageProcessor)
    assert (native.in_token_limit, native.patch_limit_on_one_side) == (784, 512)
    assert vit.grid_hw == deit.grid_hw == (14, 14)
    tiny = processor_for_config(classic_vit_config("vit-tiny"), "deit")  # 64 px: 73 px resized, 4x4 patches
    assert isinstance(tiny, ClassicViTImageProcessor) and tiny.size == (73, 73) and tiny.grid_hw == (4, 4)
    custom = processor_for_config(config, "native", in_token_limit=100, image_mean=(0.1, 0.2, 0.3))
    assert isinstance(custom, NativeViTImageProcessor) and custom.in_token_limit == 100
    with pytest.raises(ValueError, match="unknown processor rule 'clip'.*vit, deit, native"):
        processor_for_config(config, "clip")


def test_a_named_rule_takes_the_checkpoints_normalisation(tmp_path: Path) -> None:
    deit = transformers.DeiTImageProcessorPil(image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD))
    folder = _saved(tmp_path, deit, transformers.DeiTConfig(**SMALL))
    own = processor_for(folder)
    assert processor_for(folder, "deit") == own  # the folder's own kind: its own rule unchanged
    as_vit = processor_for(folder, "vit")
    assert isinstance(as_vit, ClassicViTImageProcessor)
    assert (as_vit.rule, as_vit.size, as_vit.image_mean, as_vit.image_std) == (
        "vit",
        (224, 224),
        IMAGENET_MEAN,
        IMAGENET_STD,
    )
    native = processor_for(folder, "native")
    assert isinstance(native, NativeViTImageProcessor)
    assert (native.resample, native.image_mean, native.in_token_limit) == (3, IMAGENET_MEAN, 784)
    assert processor_for(folder, "native", in_token_limit=300).in_token_limit == 300


# ---- each folder kind --------------------------------------------------------------------------


def test_own_folder_round_trips_both_rules(tmp_path: Path) -> None:
    tower = ClassicViT.from_preset("vit-tiny")
    cases: list[tuple[str, dict[str, Any]]] = [("deit", {}), ("native", {"in_token_limit": 50})]
    for rule, overrides in cases:
        folder = tmp_path / rule
        tower.save_pretrained(folder)
        processor = processor_for_config(tower.config, rule, **overrides)
        processor.save_pretrained(folder)
        assert processor_for(folder) == processor
        saved = json.loads((folder / "preprocessor_config.json").read_text())
        assert saved["image_processor_type"] == type(processor).__name__


def test_own_folder_without_a_processor_file_needs_a_rule(tmp_path: Path) -> None:
    ClassicViT.from_preset("vit-tiny").save_pretrained(tmp_path)
    with pytest.raises(
        CheckpointError, match=f"{re.escape(str(tmp_path))}: cannot tell.*preprocessor_config.json.*pretrained_cfg"
    ):
        processor_for(tmp_path)
    vit = processor_for(tmp_path, "vit")  # the named rule's own normalisation then
    assert isinstance(vit, ClassicViTImageProcessor) and vit.size == (64, 64) and vit.image_mean == (0.5,) * 3


def test_moonvit_processor_file_in_a_classic_folder_is_read(tmp_path: Path) -> None:
    ClassicViT.from_preset("vit-tiny").save_pretrained(tmp_path)
    saved = MoonViTImageProcessor(patch_size=16, merge_kernel_size=(1, 1), image_mean=IMAGENET_MEAN)
    saved.save_pretrained(tmp_path)
    assert processor_for(tmp_path) == saved
    native = processor_for(tmp_path, "native")
    assert isinstance(native, NativeViTImageProcessor) and native.image_mean == IMAGENET_MEAN


def test_moonvit_folders_keep_their_own_processor(tmp_path: Path) -> None:
    from moonvit import MoonViT

    MoonViT.from_preset("tiny").save_pretrained(tmp_path)
    MoonViTImageProcessor(in_token_limit=1024).save_pretrained(tmp_path)
    processor = processor_for(tmp_path)
    assert isinstance(processor, MoonViTImageProcessor) and processor.in_token_limit == 1024
    assert processor_for(tmp_path, "Kimi K3") == MoonViTImageProcessor.kimi_k3()  # a MoonViT family's rule by name
    with pytest.raises(ValueError, match="unknown processor rule 'native' .*MoonViT.*Kimi-VL"):
        processor_for(tmp_path, "native")


# ---- errors --------------------------------------------------------------------------------------


def test_errors_name_the_folder_file_and_key(tmp_path: Path) -> None:
    folder = _saved(tmp_path / "vit", transformers.ViTImageProcessorPil(), transformers.ViTConfig(**SMALL))
    with pytest.raises(
        ValueError, match=f"unknown processor rule 'clip' for {re.escape(str(folder))}.*vit, deit, native"
    ):
        processor_for(folder, "clip")
    with pytest.raises(CheckpointError, match="does not exist"):
        processor_for(tmp_path / "missing")
    file = folder / "preprocessor_config.json"
    values = json.loads(file.read_text())
    changes: list[tuple[dict[str, Any], str]] = [
        ({"image_processor_type": "CLIPImageProcessor"}, "image_processor_type 'CLIPImageProcessor' is not a ViT"),
        ({"size": {"longest_edge": 300}}, "size .*longest_edge"),
        ({"size": {"shortest_edge": 256}}, "shortest_edge without crop_size"),
        ({"do_resize": False}, "do_resize false"),
        (
            {"size": {"height": 200, "width": 200}},
            r"the output of 200x200 px \(size\) is not a multiple of the 16 px patch",
        ),
        ({"image_mean": [0.5, 0.5]}, "image_mean must hold 3 values"),
        ({"resample": 9}, "resample must be one of"),
    ]
    for change, message in changes:
        file.write_text(json.dumps({**values, **change}))
        with pytest.raises(CheckpointError, match=f"{re.escape(str(file))}: {message}"):
            processor_for(folder)
    file.write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{re.escape(str(file))} is not valid JSON"):
        processor_for(folder)
    file.write_text(json.dumps(values))
    with pytest.raises(ValueError, match="has no such setting"):
        processor_for(folder, patch_budget=3)
    timm = _timm_folder(tmp_path / "timm", crop_mode="border")
    with pytest.raises(CheckpointError, match="config.json: pretrained_cfg: crop_mode 'border' is not supported"):
        processor_for(timm)


# ---- in the pipeline -----------------------------------------------------------------------------


def test_every_rule_runs_through_packing_and_encoding(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tower = ClassicViT.from_preset("vit-tiny").eval()
    files = []
    for i, (height, width) in enumerate([(40, 90), (64, 64), (200, 130), (7, 300)]):
        files.append(tmp_path / f"{i}.png")
        noise_image(height, width).save(files[-1])
    for rule in ("vit", "deit", "native"):
        processor = processor_for_config(tower.config, rule)
        packs = list(pack_images(files, processor, max_patches_per_pack=64))  # planned from the headers
        grids = [item.plan.grid_hw for pack in packs for item in pack.items]
        if rule != "native":
            assert grids == [(4, 4)] * 4 and len(packs) == 1  # a fixed rule: the same grid for every image
        encoded = encode_images(tower, processor, files, max_patches_per_pack=64)  # type: ignore[arg-type]
        for file, result in zip(files, encoded.results):
            batch = processor(file)
            assert result.grid_hw == tuple(batch.grid_hws[0].tolist()) and not result.rescaled
            with torch.no_grad():
                alone = tower(batch.pixel_values, batch.grid_hws)
            torch.testing.assert_close(result.tokens, alone.merged, rtol=1e-5, atol=1e-5)
            assert result.pooled is not None
            torch.testing.assert_close(result.pooled, alone.pooled[0], rtol=1e-5, atol=1e-5)
        assert describe_processors(processor, MoonViTVideoProcessor.for_images(processor), takes_video=False)


def test_a_pack_budget_below_a_fixed_grid_is_refused() -> None:
    processor = ClassicViTImageProcessor()
    with pytest.raises(ImageSizeError, match="needs at least 196 patches.*max_patches_per_pack=100"):
        list(pack_images([np.zeros((50, 60, 3), np.uint8)], processor, max_patches_per_pack=100))


def test_to_images_inverts_the_processor() -> None:
    for processor in (
        ClassicViTImageProcessor(),
        NativeViTImageProcessor(image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD),
    ):
        image = noise_image(224, 224)
        batch = processor(image)
        (restored,) = processor.to_images(batch.pixel_values, batch.grid_hws)
        assert torch.equal(restored, torch.from_numpy(np.array(image)).permute(2, 0, 1))


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="exactly one of size and shortest_edge"):
        ClassicViTImageProcessor(shortest_edge=256, crop_size=(224, 224))
    with pytest.raises(ValueError, match="rule must be one of"):
        ClassicViTImageProcessor(rule="clip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="image_std must be positive"):
        NativeViTImageProcessor(image_std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="in_token_limit must be a positive int"):
        NativeViTImageProcessor(in_token_limit=0)
    with pytest.raises(ValueError, match="in_token_limit must be a positive int"):
        NativeViTImageProcessor().plan_image(10, 10, in_token_limit=0)
    with pytest.raises(ValueError, match="image size must be positive"):
        ClassicViTImageProcessor().plan_image(0, 10)
