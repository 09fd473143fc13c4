"""SigLIP's, SigLIP2 NaFlex's and DINOv2's processors (moonvit.families.siglip.processor,
moonvit.families.dinov2.processor) and choosing them by name.

Pinned, pixel for pixel (``torch.equal`` in float32: a max abs difference of 0), against
transformers' PIL-backend processors (``SiglipImageProcessorPil``, ``Siglip2ImageProcessorPil``,
``BitImageProcessorPil``), ours read from the ``preprocessor_config.json`` that transformers'
``save_pretrained`` writes; timm's folders against a plain reference of timm's evaluation transform
(timm is not a dependency). SigLIP2's patches are compared with the unpadded rows of transformers'
output, its (row, column, channel) flattening turned into our (C, p, p).
"""

from __future__ import annotations

import dataclasses
import json
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

from moonvit.families.dinov2.processor import DINOV2_RULES
from moonvit.families.siglip.processor import SIGLIP2_RULES, SIGLIP_RULES, NaFlexImageProcessor, naflex_grid
from moonvit.families.vit.config import ClassicViTConfig
from moonvit.families.vit.processor import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ClassicViTImageProcessor,
    NativeViTImageProcessor,
)
from moonvit.media import pack_images, processor_for
from moonvit.media.presets import describe_processors
from moonvit.media.video import MoonViTVideoProcessor
from moonvit.weights.storage import CheckpointError

transformers = pytest.importorskip("transformers")

# Sizes (height, width): a pixel, tiny and odd, square, tall, wide, very thin both ways, large.
SIZES = [(1, 1), (2, 3), (3, 5), (17, 9), (224, 224), (255, 257), (300, 199), (97, 1303), (1303, 41), (1537, 2001)]
TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
# Modes that transformers' do_convert_rgb and our decoder turn into the same RGB (alpha over white);
# 16-bit and float modes differ on purpose (we map their whole range; Pillow's convert clips at 255).
MODES = ["L", "LA", "RGBA", "P", "P-transparency", "CMYK", "1", "RGB"]


def _mode_image(mode: str, height: int = 37, width: int = 53) -> Image.Image:
    rng = np.random.default_rng(len(mode) * 101 + height)
    if mode == "P-transparency":
        image = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "P")
        image.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tolist())
        image.info["transparency"] = 7
        return image
    if mode == "P":
        return noise_image(height, width).convert("P", palette=Image.Palette.ADAPTIVE)
    if mode in ("L", "1"):
        return Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8)).convert(mode)
    bands = len(Image.new(mode, (1, 1)).getbands())
    return Image.fromarray(rng.integers(0, 256, (height, width, bands), dtype=np.uint8), mode)


def _check_equal(case: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype == torch.float32, case
    assert got.shape == expected.shape, (case, got.shape, expected.shape)
    assert torch.equal(got, expected), (case, (got - expected).abs().max().item())


def _saved(folder: Path, processor: Any, config: Any) -> Path:
    """A transformers folder: its config.json and the processor's preprocessor_config.json."""
    config.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _quiet(function: Any, *args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' token-id and backend notes
        return function(*args)


# ---- SigLIP: a square resize ---------------------------------------------------------------------

SIGLIP_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # (transformers processor kwargs, SiglipVisionConfig kwargs)
    "siglip-224": ({}, {"patch_size": 16, "image_size": 224}),
    "siglip-256-bilinear-unscaled": (
        {"size": {"height": 256, "width": 256}, "resample": 2, "do_rescale": False},
        {"patch_size": 16, "image_size": 256},
    ),
    "siglip-96-lanczos-imagenet": (
        {"size": {"height": 96, "width": 96}, "resample": 1, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD},
        {"patch_size": 8, "image_size": 96},
    ),
    "siglip-unnormalised": ({"do_normalize": False}, {"patch_size": 14, "image_size": 224}),
}


@pytest.mark.parametrize("case", sorted(SIGLIP_CASES))
def test_siglip_equals_transformers_pixel_for_pixel(case: str, tmp_path: Path) -> None:
    kwargs, vision = SIGLIP_CASES[case]
    theirs = transformers.SiglipImageProcessorPil(**kwargs)
    ours = processor_for(_saved(tmp_path, theirs, transformers.SiglipVisionConfig(**TINY, **vision)))
    assert isinstance(ours, ClassicViTImageProcessor) and ours.rule == "siglip" and ours.crop_size is None
    for height, width in SIZES:
        image = noise_image(height, width)
        _check_equal(f"{case} {height}x{width}", our_image(ours, image), their_image(theirs, image))


def test_siglip_at_384_px_and_patch_14_keeps_the_patches_the_convolution_reads(tmp_path: Path) -> None:
    """so400m/14 at 384 px: transformers' 384 x 384 pixels, of which its stride-14 convolution reads
    the top-left 27 x 27 patches (378 px); ours are those patches."""
    theirs = transformers.SiglipImageProcessorPil(size={"height": 384, "width": 384})
    ours = processor_for(
        _saved(tmp_path, theirs, transformers.SiglipVisionConfig(**TINY, patch_size=14, image_size=384))
    )
    assert isinstance(ours, ClassicViTImageProcessor) and ours.rule == "siglip"
    assert ours.grid_hw == (27, 27) and ours.plan_image(500, 300).box == (0, 0, 378, 378)
    for height, width in SIZES:
        image = noise_image(height, width)
        _check_equal(
            f"siglip-384-p14 {height}x{width}", our_image(ours, image), their_image(theirs, image)[:, :378, :378]
        )
    assert "top-left 378x378 px kept" in ours.describe()


def test_the_siglip_rule_by_name_resizes_so400m_14_to_384_px(tmp_path: Path) -> None:
    """``--image-rule siglip`` on so400m/14 at 384 px without a transformers processor file (a transformers folder
    without one, timm's ``vit_so400m_patch14_siglip_384``): the rule built from the tower resizes to the release's
    384 px, as transformers' processor does, and keeps the top-left 27 x 27 patches (378 px) the convolution
    reads, not a resize to the table's 378 px."""
    from moonvit.encode import checkpoint_processors
    from moonvit.families.vit import ClassicViT
    from moonvit.weights.checkpoint import read_config

    transformers.SiglipVisionConfig(**TINY, patch_size=14, image_size=384).save_pretrained(tmp_path / "transformers")
    timm = {
        "architecture": "vit_so400m_patch14_siglip_384",
        "model_args": {"embed_dim": 32, "depth": 1, "num_heads": 2},
        "num_classes": 0,
        "global_pool": "map",
        "pretrained_cfg": {"input_size": [3, 384, 384], "interpolation": "bicubic", "crop_pct": 1.0,
                           "mean": [0.5] * 3, "std": [0.5] * 3},
    }  # fmt: skip
    (tmp_path / "timm").mkdir()
    (tmp_path / "timm" / "config.json").write_text(json.dumps(timm))
    theirs = transformers.SiglipImageProcessorPil(size={"height": 384, "width": 384})
    for name in ("transformers", "timm"):
        config, _ = read_config(tmp_path / name)
        assert (config.image_size, config.input_size, config.grid_side) == (378, 384, 27)
        ours = checkpoint_processors(tmp_path / name, config, rule="siglip").image
        assert isinstance(ours, ClassicViTImageProcessor) and ours.rule == "siglip" and ours.size == (384, 384)
        assert ours.grid_hw == (27, 27)
        for height, width in [(5, 3), (300, 199), (97, 1303), (384, 384)]:
            image = noise_image(height, width)
            _check_equal(f"{name} {height}x{width}", our_image(ours, image), their_image(theirs, image)[:, :378, :378])
    with pytest.raises(
        ValueError, match="input_size 392 is not a size in px whose whole 14 px patches are the table's 27"
    ):
        dataclasses.replace(config, input_size=392)  # 28 patches
    assert dataclasses.replace(config, input_size=378).input_size is None  # the table's own size, one spelling
    tower = ClassicViT(config)
    tower.resize_position_table(448)  # a new table: the release's size no longer applies
    assert (tower.config.image_size, tower.config.input_size) == (448, None)


# ---- SigLIP2 NaFlex --------------------------------------------------------------------------------


def _naflex_theirs(processor: Any, image: Image.Image, patch: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """transformers' NaFlex output for one image: its unpadded patches as (n, 3, p, p) and its grid."""
    out = processor(image, return_tensors="pt")
    rows, cols = (int(v) for v in out["spatial_shapes"][0])
    mask = out["pixel_attention_mask"][0]
    assert int(mask.sum()) == rows * cols and bool(mask[: rows * cols].all())
    patches = out["pixel_values"][0, : rows * cols].reshape(rows * cols, patch, patch, 3).permute(0, 3, 1, 2)
    return patches.contiguous(), (rows, cols)


NAFLEX_CASES = [(64, 16), (256, 16), (1024, 16), (256, 14), (729, 14), (100, 8)]


@pytest.mark.parametrize(("budget", "patch"), NAFLEX_CASES)
def test_naflex_equals_transformers_unpadded_pixel_for_pixel(budget: int, patch: int, tmp_path: Path) -> None:
    theirs = transformers.Siglip2ImageProcessorPil(max_num_patches=budget, patch_size=patch)
    config = transformers.Siglip2VisionConfig(**TINY, patch_size=patch, num_patches=256)
    ours = processor_for(_saved(tmp_path, theirs, config))
    assert ours == NaFlexImageProcessor(patch_size=patch, max_num_patches=budget)
    for height, width in SIZES:
        image = noise_image(height, width)
        expected, grid = _naflex_theirs(theirs, image, patch)
        batch = ours(image)
        assert tuple(batch.grid_hws[0].tolist()) == grid == ours.plan_image(width, height).grid_hw
        _check_equal(f"naflex-{budget}-p{patch} {height}x{width}", batch.pixel_values, expected)


def test_naflex_grid_is_transformers_rule() -> None:
    """The grid from sizes alone, against transformers' get_image_size_for_max_num_patches."""
    from transformers.models.siglip2.image_processing_pil_siglip2 import get_image_size_for_max_num_patches

    rng = np.random.default_rng(5)
    cases = [(1, 1), (1, 100000), (100000, 1), (16, 16), (512, 512), (3, 5000)]
    cases += [(int(h), int(w)) for h, w in rng.integers(1, 6000, (400, 2))]
    for height, width in cases:
        for patch, budget in [(16, 256), (14, 729), (16, 1), (8, 7), (16, 4096)]:
            rows, cols = naflex_grid(height, width, patch, budget)
            expected = get_image_size_for_max_num_patches(height, width, patch, budget)
            assert (rows * patch, cols * patch) == expected, (height, width, patch, budget)
            assert rows * cols <= budget


def test_naflex_scales_small_images_up_and_takes_the_pipeline_budget() -> None:
    processor = NaFlexImageProcessor()
    assert processor.plan_image(32, 32).grid_hw == (16, 16)  # 2 x 2 patches' worth, scaled up to the budget
    assert processor.plan_image(640, 480).grid_hw == (14, 18)  # sides rounded up: 252 patches, about 4:3
    assert processor.plan_image(640, 480, in_token_limit=48).grid_hw == (6, 8)
    assert processor.in_token_limit == 256
    packs = list(pack_images([np.zeros((480, 640, 3), np.uint8)] * 3, processor, max_patches_per_pack=400))
    assert [[item.plan.grid_hw for item in pack.items] for pack in packs] == [[(14, 18)]] * 3
    (small,) = pack_images([np.zeros((480, 640, 3), np.uint8)], processor, max_patches_per_pack=100)
    assert small.items[0].plan.num_patches <= 100  # one image over the pack's budget: scaled down to fit
    assert "NaFlex" in describe_processors(processor, MoonViTVideoProcessor.for_images(processor), takes_video=False)
    batch = processor(noise_image(64, 48))
    (restored,) = processor.to_images(batch.pixel_values, batch.grid_hws)
    assert restored.shape == (3, 288, 224)  # 18 x 14 patches


def test_naflex_caps_each_side_at_the_towers_side_limit() -> None:
    """A budget over the tower's ``max_grid_side`` lets NaFlex give a thin image more patches along one side than
    the tower takes (1 x 1000 at 1024 patches): the naflex rule caps each side at it, as the native rule does, and
    the tower runs the image; grids within the limit are NaFlex's."""
    from moonvit.families.vit import ClassicViT

    config = ClassicViTConfig(**TINY, patch_size=16, image_size=64, class_token=False, pool="avg",
                              pos_emb_rule="naflex", max_grid_side=40)  # fmt: skip
    processor = SIGLIP2_RULES.for_config(config, "naflex", max_num_patches=1024)
    assert isinstance(processor, NaFlexImageProcessor) and processor.patch_limit_on_one_side == 40
    assert naflex_grid(16, 16000, 16, 1024) == (1, 1000)
    assert processor.plan_image(16000, 16).grid_hw == (1, 40) and processor.plan_image(16, 16000).grid_hw == (40, 1)
    assert processor.plan_image(16000, 16).resized_size == (640, 16)
    assert processor.plan_image(640, 480).grid_hw == naflex_grid(480, 640, 16, 1024) == (27, 36)
    assert "sides over 40 capped" in processor.describe()
    batch = processor([noise_image(16, 16000), noise_image(480, 640)])
    assert batch.grid_hws.tolist() == [[1, 40], [27, 36]]
    tower = ClassicViT(config).eval()
    with torch.no_grad():
        out = tower(batch.pixel_values, batch.grid_hws)
    assert out.last_hidden_state.shape == (40 + 27 * 36, 32)


# ---- DINOv2: shorter side, centre crop ----------------------------------------------------------

DINOV2_RELEASE = {
    "size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224}, "resample": 3,
    "image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD),
}  # fmt: skip
DINOV2_CASES: dict[str, dict[str, Any]] = {
    "dinov2-release": DINOV2_RELEASE,
    "dinov2-no-crop": {**DINOV2_RELEASE, "size": {"height": 224, "width": 224}, "do_center_crop": False},
    "dinov2-crop-past-edges": {**DINOV2_RELEASE, "size": {"height": 196, "width": 210}},
    "bit-defaults": {},  # CLIP's statistics, shorter side 224
}


@pytest.mark.parametrize("case", sorted(DINOV2_CASES))
def test_dinov2_equals_transformers_pixel_for_pixel(case: str, tmp_path: Path) -> None:
    theirs = transformers.BitImageProcessorPil(**DINOV2_CASES[case])
    folder = _saved(tmp_path, theirs, transformers.Dinov2Config(**TINY, image_size=56))
    ours = _quiet(processor_for, folder)
    assert isinstance(ours, ClassicViTImageProcessor) and ours.rule == "dinov2"
    assert (ours.crop_size is None) == (case == "dinov2-no-crop")
    for height, width in SIZES:
        image = noise_image(height, width)
        _check_equal(f"{case} {height}x{width}", our_image(ours, image), their_image(theirs, image))


def test_files_without_their_class_defaults_and_of_the_older_form(tmp_path: Path) -> None:
    """A file that leaves keys to the class defaults, and ``feature_extractor_type`` names."""
    files = {
        "siglip": ({"image_processor_type": "SiglipImageProcessor"}, transformers.SiglipVisionConfig(**TINY)),
        "naflex": (
            {"image_processor_type": "Siglip2ImageProcessor"},
            transformers.Siglip2VisionConfig(**TINY, patch_size=16),
        ),
        "bit": ({"feature_extractor_type": "BitFeatureExtractor"}, transformers.Dinov2Config(**TINY, image_size=56)),
        "vit-in-dinov2": (
            {"feature_extractor_type": "ViTFeatureExtractor", "size": 224, "image_mean": list(IMAGENET_MEAN),
             "image_std": list(IMAGENET_STD), "resample": 3},
            transformers.Dinov2Config(**TINY, image_size=56),
        ),
    }  # fmt: skip
    for name, (values, config) in files.items():
        folder = tmp_path / name
        config.save_pretrained(folder)
        (folder / "preprocessor_config.json").write_text(json.dumps(values))
        theirs = _quiet(transformers.AutoImageProcessor.from_pretrained, folder)
        ours = _quiet(processor_for, folder)
        for height, width in [(5, 3), (300, 199), (97, 1303)]:
            image = noise_image(height, width)
            if name == "naflex":
                patch = theirs.patch_size
                expected, _ = _naflex_theirs(theirs, image, patch)
                _check_equal(f"{name} defaults {height}x{width}", ours(image).pixel_values, expected)
            else:
                _check_equal(f"{name} defaults {height}x{width}", our_image(ours, image), their_image(theirs, image))


# ---- image modes ---------------------------------------------------------------------------------


def test_image_modes_equal_transformers_conversion(tmp_path: Path) -> None:
    """Each mode decoded to RGB (alpha over white) as transformers' ``do_convert_rgb`` does it
    (SigLIP2's class leaves it unset: set here, as its 1- and 4-band arrays are not RGB)."""
    siglip = transformers.SiglipImageProcessorPil(size={"height": 64, "width": 64})
    naflex = transformers.Siglip2ImageProcessorPil(max_num_patches=64, do_convert_rgb=True)
    bit = transformers.BitImageProcessorPil(**DINOV2_RELEASE)
    ours_siglip = processor_for(_saved(tmp_path / "s", siglip, transformers.SiglipVisionConfig(**TINY)))
    ours_naflex = processor_for(_saved(tmp_path / "n", naflex, transformers.Siglip2VisionConfig(**TINY)))
    ours_bit = _quiet(processor_for, _saved(tmp_path / "d", bit, transformers.Dinov2Config(**TINY, image_size=56)))
    for mode in MODES:
        image = _mode_image(mode)
        assert image.mode == mode.split("-")[0]
        _check_equal(f"siglip {mode}", our_image(ours_siglip, image), their_image(siglip, image))
        _check_equal(f"dinov2 {mode}", our_image(ours_bit, image), their_image(bit, image))
        expected, _ = _naflex_theirs(naflex, image, 16)
        _check_equal(f"naflex {mode}", ours_naflex(image).pixel_values, expected)


# ---- timm's folders --------------------------------------------------------------------------------


def _timm_folder(folder: Path, architecture: str, **pretrained: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    pool = "map" if "siglip" in architecture else "token"
    cfg = {"architecture": architecture, "num_classes": 0, "global_pool": pool, "pretrained_cfg": pretrained}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


TIMM_CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    # architecture, pretrained_cfg, patch
    "so400m-224": (
        "vit_so400m_patch14_siglip_224.webli",
        {"input_size": [3, 224, 224], "interpolation": "bicubic", "crop_pct": 1.0, "mean": [0.5] * 3, "std": [0.5] * 3},
        14,
    ),
    "dinov2-reg4-518": (
        "vit_small_patch14_reg4_dinov2.lvd142m",
        {"input_size": [3, 518, 518], "interpolation": "bicubic", "crop_pct": 1.0, "mean": list(IMAGENET_MEAN),
         "std": list(IMAGENET_STD)},
        14,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TIMM_CASES))
def test_timm_folders_take_timms_evaluation_transform(case: str, tmp_path: Path) -> None:
    architecture, pretrained, patch = TIMM_CASES[case]
    folder = _timm_folder(tmp_path, architecture, **pretrained)
    ours = _quiet(processor_for, folder)
    size = pretrained["input_size"][1]
    assert isinstance(ours, ClassicViTImageProcessor) and ours.rule == "timm"
    assert ours.grid_hw == (size // patch, size // patch)
    for height, width in SIZES:
        image = noise_image(height, width)
        expected = timm_eval_transform(image, size, 1.0, 3, pretrained["mean"], pretrained["std"])
        _check_equal(f"timm {case} {height}x{width}", our_image(ours, image), expected)


# ---- rules by name ---------------------------------------------------------------------------------


def test_rules_by_name(tmp_path: Path) -> None:
    siglip = _saved(tmp_path / "siglip", transformers.SiglipImageProcessorPil(),
                    transformers.SiglipVisionConfig(**TINY, patch_size=16, image_size=224))  # fmt: skip
    assert processor_for(siglip, "siglip") == processor_for(siglip)
    native = processor_for(siglip, "native")
    assert isinstance(native, NativeViTImageProcessor)
    assert (native.patch_size, native.in_token_limit, native.resample, native.image_mean) == (16, 784, 3, (0.5,) * 3)
    assert processor_for(siglip, "native", in_token_limit=300).in_token_limit == 300

    naflex = _saved(tmp_path / "naflex", transformers.Siglip2ImageProcessorPil(max_num_patches=1024),
                    transformers.Siglip2VisionConfig(**TINY, patch_size=16, num_patches=256))  # fmt: skip
    own = processor_for(naflex)
    assert isinstance(own, NaFlexImageProcessor) and own.max_num_patches == 1024
    assert processor_for(naflex, "naflex") == processor_for(naflex, "native") == own  # native: another name
    assert processor_for(naflex, "native", max_num_patches=64) == NaFlexImageProcessor(max_num_patches=64)
    square = processor_for(naflex, "siglip")  # the table's native size, 16 x 16 patches
    assert isinstance(square, ClassicViTImageProcessor) and square.size == (256, 256) and square.grid_hw == (16, 16)

    dinov2 = _saved(tmp_path / "dinov2", transformers.BitImageProcessorPil(**DINOV2_RELEASE),
                    transformers.Dinov2Config(**TINY, image_size=518))  # fmt: skip
    own_dinov2 = _quiet(processor_for, dinov2)
    assert _quiet(processor_for, dinov2, "dinov2") == own_dinov2
    native_dinov2 = _quiet(processor_for, dinov2, "native")
    assert isinstance(native_dinov2, NativeViTImageProcessor)
    assert (native_dinov2.patch_size, native_dinov2.in_token_limit, native_dinov2.image_mean) == (
        14, 4 * 37 * 37, IMAGENET_MEAN,
    )  # fmt: skip
    image = noise_image(300, 199)
    assert torch.equal(our_image(own_dinov2, image), our_image(_quiet(processor_for, dinov2, "dinov2"), image))

    assert (SIGLIP_RULES.names, SIGLIP2_RULES.names, DINOV2_RULES.names) == (
        ("siglip", "native"), ("naflex", "siglip", "native"), ("dinov2", "native"),
    )  # fmt: skip
    for folder, rules in [(siglip, "siglip, native"), (naflex, "naflex, siglip, native"), (dinov2, "dinov2, native")]:
        with pytest.raises(ValueError, match=f"unknown processor rule 'deit' for {re.escape(str(folder))}.*{rules}"):
            _quiet(processor_for, folder, "deit")


def test_rules_without_a_processor_file_take_the_familys_own_settings(tmp_path: Path) -> None:
    folders = {
        "siglip": transformers.SiglipVisionConfig(**TINY, patch_size=16, image_size=224),
        "naflex": transformers.Siglip2VisionConfig(**TINY, patch_size=16, num_patches=256),
        "dinov2": transformers.Dinov2Config(**TINY, image_size=518),
    }
    for name, config in folders.items():
        config.save_pretrained(tmp_path / name)
        with pytest.raises(CheckpointError, match=f"{re.escape(str(tmp_path / name))}: cannot tell.*rule by name"):
            _quiet(processor_for, tmp_path / name)
    assert processor_for(tmp_path / "siglip", "siglip") == ClassicViTImageProcessor(rule="siglip", resample=3,
                                                                                    drop_remainder=True)  # fmt: skip
    assert processor_for(tmp_path / "naflex", "native") == NaFlexImageProcessor()
    dinov2 = _quiet(processor_for, tmp_path / "dinov2", "dinov2")
    assert dinov2 == ClassicViTImageProcessor(
        rule="dinov2", patch_size=14, size=None, shortest_edge=256, crop_size=(224, 224), resample=3,
        image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD,
    )  # fmt: skip
    native = _quiet(processor_for, tmp_path / "dinov2", "native")
    assert isinstance(native, NativeViTImageProcessor) and native.image_mean == IMAGENET_MEAN


def test_own_files_round_trip(tmp_path: Path) -> None:
    config = transformers.Siglip2VisionConfig(**TINY, patch_size=16)
    for processor in (NaFlexImageProcessor(max_num_patches=77), NativeViTImageProcessor(in_token_limit=50)):
        folder = tmp_path / type(processor).__name__
        config.save_pretrained(folder)
        processor.save_pretrained(folder)
        assert processor_for(folder) == processor


def test_errors_name_the_file_and_the_setting(tmp_path: Path) -> None:
    folder = _saved(tmp_path, transformers.Siglip2ImageProcessorPil(), transformers.Siglip2VisionConfig(**TINY))
    file = folder / "preprocessor_config.json"
    values = json.loads(file.read_text())
    changes: list[tuple[dict[str, Any], str]] = [
        ({"patch_size": 14}, "patch_size 14 is not the tower's 16 px patch"),
        ({"do_resize": False}, "do_resize false"),
        ({"max_num_patches": 0}, "max_num_patches must be a positive int"),
        (
            {"image_processor_type": "CLIPImageProcessor"},
            "image_processor_type 'CLIPImageProcessor' is not a Siglip or Siglip2 processor",
        ),
    ]
    for change, message in changes:
        file.write_text(json.dumps({**values, **change}))
        with pytest.raises(CheckpointError, match=f"{re.escape(str(file))}: {message}"):
            processor_for(folder)
    file.write_text(json.dumps(values))
    with pytest.raises(ValueError, match="has no such setting"):
        processor_for(folder, in_token_limit=3)
    with pytest.raises(ValueError, match="NaFlexImageProcessor has no setting crop_size"):
        SIGLIP2_RULES.for_config(ClassicViTConfig(**TINY), "naflex", crop_size=(3, 3))
    with pytest.raises(ValueError, match="image size must be positive"):
        NaFlexImageProcessor().plan_image(0, 5)


def test_a_saved_tower_keeps_its_familys_rules(tmp_path):
    """A SigLIP2 or DINOv2 tower saved in the classic ViT's own format (``model_type classic_vit``, its
    ``family`` recorded) is read by its family's rules, by the commands and by name: NaFlex's for SigLIP2,
    DINOv2's ImageNet statistics for DINOv2, not the classic ViT's rules and 0.5 / 0.5."""
    from transformers import Dinov2Config, Dinov2Model, Siglip2VisionConfig, Siglip2VisionModel

    from moonvit import MoonViT
    from moonvit.encode import checkpoint_processors

    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    Siglip2VisionModel(
        Siglip2VisionConfig(**small, intermediate_size=64, num_patches=16, patch_size=8)
    ).save_pretrained(tmp_path / "siglip2")
    Dinov2Model(Dinov2Config(**small, image_size=28, patch_size=14)).save_pretrained(tmp_path / "dinov2")
    for name, rule in (("siglip2", "naflex"), ("dinov2", "dinov2")):
        tower = MoonViT.from_pretrained(tmp_path / name)
        tower.save_pretrained(tmp_path / f"{name}-own")
        saved = json.loads((tmp_path / f"{name}-own" / "config.json").read_text())
        assert (saved["model_type"], saved["family"]) == ("classic_vit", name)
        theirs = checkpoint_processors(tmp_path / name, tower.config).image
        ours = checkpoint_processors(tmp_path / f"{name}-own", MoonViT.from_pretrained(tmp_path / f"{name}-own").config)
        assert ours.image.describe() == theirs.describe()
        assert (
            processor_for(tmp_path / f"{name}-own", rule).describe() == processor_for(tmp_path / name, rule).describe()
        )
    siglip2 = MoonViT.from_pretrained(tmp_path / "siglip2-own").config
    assert "NaFlex" in checkpoint_processors(tmp_path / "siglip2-own", siglip2).image.describe()
    assert "0.485/0.456/0.406" in checkpoint_processors(tmp_path / "dinov2-own", tower.config).image.describe()
