"""MoonViTImageProcessor with NVIDIA LocateAnything-3B's rule, against the rule written out with Pillow."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from moonvit import MoonViTImageProcessor
from moonvit.media.processor import CONFIG_NAME, ImageSizeError, load_image

P = 14
UNIT = 28  # patch 14 x merge 2
LIMIT = 25600

# LocateAnything-3B's preprocessor_config.json: no image_processor_type
LOCATEANYTHING_CONFIG = {
    "auto_map": {
        "AutoImageProcessor": "image_processing_locateanything.LocateAnythingImageProcessor",
        "AutoProcessor": "processing_locateanything.LocateAnythingProcessor",
    },
    "in_token_limit": 25600,
    "patch_size": 14,
    "merge_kernel_size": [2, 2],
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
LOCATEANYTHING_MODEL_CONFIG = {
    "model_type": "locateanything",
    "architectures": ["LocateAnythingForConditionalGeneration"],
    "vision_config": {"model_type": "moonvit", "hidden_size": 1152, "patch_size": 14, "merge_kernel_size": [2, 2]},
}


def reference(image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
    """LocateAnything's rule written out: ((rows * cols, 3, 14, 14) float32 pixel values, (rows, cols)).

    Raises ValueError for a side of 512 patches or more.
    """
    if image.mode == "RGBA":
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.split()[3])
    else:
        rgb = image.convert("RGB")
    w, h = rgb.size
    patches = (w // P) * (h // P)
    if patches > LIMIT:
        s = math.sqrt(LIMIT / patches)
        rgb = rgb.resize((int(w * s), int(h * s)), Image.Resampling.BICUBIC)
        w, h = rgb.size
    if w % UNIT or h % UNIT:
        rgb = rgb.resize((math.ceil(w / UNIT) * UNIT, math.ceil(h / UNIT) * UNIT), Image.Resampling.BICUBIC)
        w, h = rgb.size
    rows, cols = h // P, w // P
    if rows >= 512 or cols >= 512:
        raise ValueError(f"{rows}x{cols} patches")
    x = np.asarray(rgb).astype(np.float32) / np.float32(255)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    out = [x[r * P : (r + 1) * P, c * P : (c + 1) * P].transpose(2, 0, 1) for r in range(rows) for c in range(cols)]
    return np.stack(out), (rows, cols)


def noise(width: int, height: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


def assert_matches_reference(image: Image.Image) -> tuple[int, int]:
    expected, grid = reference(image)
    batch = MoonViTImageProcessor.locateanything()(image)
    assert batch.grid_hws.tolist() == [list(grid)]
    assert torch.equal(batch.pixel_values, torch.from_numpy(expected))
    return grid


# ---- geometry and pixels ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "width, height, grid",
    [
        (1, 1, (2, 2)),  # stretched up to 28 x 28
        (5, 3, (2, 2)),
        (27, 29, (4, 2)),  # 28 x 56
        (3000, 20, (2, 216)),  # thin strips: 3024 x 28, 28 x 2016
        (20, 2000, (144, 2)),
        (56, 84, (6, 4)),  # multiples of 28: no resize at all
        (448, 448, (32, 32)),  # 256 tokens
        (3000, 2000, (132, 198)),  # over the limit: 2753 x 1835, then 2772 x 1848
        (6000, 1500, (82, 322)),  # over the limit: 4485 x 1121, then 4508 x 1148
        (2311, 2311, (160, 160)),  # the limit resize lands on 2240 x 2240: no stretch
    ],
)
def test_pixels_and_grid_equal_the_rule_written_out(width, height, grid):
    assert assert_matches_reference(Image.fromarray(noise(width, height))) == grid


def test_plans_record_both_resizes():
    processor = MoonViTImageProcessor.locateanything()
    # (3000 // 14) * (2000 // 14) = 30388 > 25600: s = sqrt(25600 / 30388) = 0.91785, 2753.5 x 1835.7
    plan = processor.plan_image(3000, 2000)
    assert (plan.resized_size, plan.stretched_size, plan.grid_hw) == ((2753, 1835), (2772, 1848), (132, 198))
    assert plan.box == (0, 0, 2753, 1835)
    plan = processor.plan_image(27, 29)
    assert (plan.resized_size, plan.stretched_size, plan.grid_hw) == ((27, 29), (28, 56), (4, 2))
    plan = processor.plan_image(56, 84)
    assert (plan.resized_size, plan.stretched_size, plan.box) == ((56, 84), None, (0, 0, 56, 84))
    assert processor.plan_image(2311, 2311).stretched_size is None


def test_two_resizes_differ_from_one():
    image = Image.fromarray(noise(3000, 2000, seed=1))
    processor = MoonViTImageProcessor.locateanything()
    plan = processor.plan_image(*image.size)
    one = np.asarray(image.resize(plan.stretched_size, Image.Resampling.BICUBIC))
    assert not np.array_equal(processor.render(image, plan).permute(1, 2, 0).numpy(), one)


def test_rgba_is_composited_on_white():
    pixels = noise(60, 40, seed=2, channels=4)
    pixels[..., 3] = np.linspace(0, 255, 60).astype(np.uint8)  # alpha ramps left to right
    image = Image.fromarray(pixels)
    assert image.mode == "RGBA"
    assert_matches_reference(image)
    assert np.asarray(load_image(image, alpha_mode="composite_rgba"))[:, 0].tolist() == [[255, 255, 255]] * 40


def test_pillow_paste_with_mask_equals_alpha_composite_on_white():
    value, alpha = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8))
    image = Image.fromarray(np.dstack([value, 255 - value, value // 2, alpha]))
    composited = Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")
    pasted = Image.new("RGB", image.size, (255, 255, 255))
    pasted.paste(image, mask=image.split()[3])
    assert np.array_equal(np.asarray(composited), np.asarray(pasted))


def test_la_alpha_is_dropped_not_composited():
    grey = np.random.default_rng(3).integers(0, 200, (30, 50), dtype=np.uint8)
    image = Image.fromarray(np.dstack([grey, np.zeros_like(grey)]))  # fully transparent
    assert image.mode == "LA"
    assert_matches_reference(image)
    assert np.array_equal(np.asarray(load_image(image, alpha_mode="composite_rgba"))[..., 0], grey)


def test_transparency_keys_are_dropped():
    palette = Image.new("P", (2, 1))
    palette.putpalette([10, 20, 30, 40, 50, 60])
    palette.putpixel((1, 0), 1)
    palette.info["transparency"] = 0
    assert np.asarray(load_image(palette, alpha_mode="composite_rgba"))[0].tolist() == [[10, 20, 30], [40, 50, 60]]
    rgb = Image.fromarray(noise(30, 30, seed=4))
    rgb.info["transparency"] = tuple(int(v) for v in np.asarray(rgb)[0, 0])
    assert_matches_reference(rgb)
    assert_matches_reference(Image.fromarray(noise(30, 30, seed=5, channels=4)).convert("PA"))


def test_grey_l():
    image = Image.fromarray(noise(100, 70, seed=6)[..., 0])
    assert image.mode == "L"
    assert_matches_reference(image)


@pytest.mark.parametrize("width, height", [(7168, 28), (7167, 28), (28, 7168)])
def test_a_side_of_512_patches_is_refused(width, height):
    with pytest.raises(ValueError):
        reference(Image.new("RGB", (width, height)))
    with pytest.raises(ImageSizeError, match=r"(2x512|512x2) patch grid: a side over 511 patches"):
        MoonViTImageProcessor.locateanything().plan_image(width, height)


def test_a_side_of_510_patches_is_accepted():
    assert MoonViTImageProcessor.locateanything().plan_image(7140, 28).grid_hw == (2, 510)
    assert_matches_reference(Image.fromarray(noise(7140, 28, seed=7)))


def test_stretch_conflicts_with_cropping():
    with pytest.raises(ValueError, match="stretch_input=True and pad_input=False"):
        MoonViTImageProcessor(stretch_input=True, pad_input=False)
    with pytest.raises(ValueError, match="stretch_input must be a bool"):
        MoonViTImageProcessor(stretch_input="yes")  # type: ignore[arg-type]


# ---- configuration ----------------------------------------------------------------------------


def write(folder, name, values):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(values))


def test_from_pretrained_recognises_the_auto_map(tmp_path):
    write(tmp_path, CONFIG_NAME, LOCATEANYTHING_CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for LocateAnything's bookkeeping keys
        processor = MoonViTImageProcessor.from_pretrained(tmp_path)
    assert processor == MoonViTImageProcessor.locateanything()
    assert processor.in_token_limit == 25600 and processor.stretch_input
    assert MoonViTImageProcessor.from_pretrained(tmp_path / CONFIG_NAME) == processor


def test_the_files_limit_wins(tmp_path):
    write(tmp_path, CONFIG_NAME, {**LOCATEANYTHING_CONFIG, "in_token_limit": 4096})
    assert MoonViTImageProcessor.from_pretrained(tmp_path) == MoonViTImageProcessor.locateanything(in_token_limit=4096)
    assert MoonViTImageProcessor.from_pretrained(tmp_path, in_token_limit=100).in_token_limit == 100


def test_from_pretrained_recognises_the_model_config_beside_it(tmp_path):
    config = {k: v for k, v in LOCATEANYTHING_CONFIG.items() if k != "auto_map"}
    write(tmp_path, CONFIG_NAME, config)
    write(tmp_path, "config.json", LOCATEANYTHING_MODEL_CONFIG)
    assert MoonViTImageProcessor.from_pretrained(tmp_path) == MoonViTImageProcessor.locateanything()
    assert MoonViTImageProcessor.from_pretrained(tmp_path / CONFIG_NAME) == MoonViTImageProcessor.locateanything()


def test_a_locateanything_folder_without_a_processor_config(tmp_path):
    write(tmp_path, "config.json", LOCATEANYTHING_MODEL_CONFIG)
    processor = MoonViTImageProcessor.from_pretrained(tmp_path)
    assert processor == MoonViTImageProcessor.locateanything() and processor.in_token_limit == 25600


def test_save_and_load_round_trip(tmp_path):
    processor = MoonViTImageProcessor.locateanything(in_token_limit=1000)
    path = processor.save_pretrained(tmp_path)
    saved = json.loads(path.read_text())
    assert (saved["stretch_input"], saved["alpha_mode"], saved["patch_limit_on_one_side"]) == (
        True,
        "composite_rgba",
        511,
    )
    loaded = MoonViTImageProcessor.from_pretrained(tmp_path)
    assert loaded.to_dict() == processor.to_dict() and loaded == processor


def test_kimi_vl_form_still_pads(tmp_path):
    config = {
        "auto_map": {"AutoImageProcessor": "image_processing_kimi_vl.KimiVLImageProcessor"},
        "image_processor_type": "KimiVLImageProcessor",
        "in_token_limit": 16384,
        "merge_kernel_size": [2, 2],
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    write(tmp_path, CONFIG_NAME, config)
    write(tmp_path, "config.json", LOCATEANYTHING_MODEL_CONFIG)  # the file names its type: it decides
    processor = MoonViTImageProcessor.from_pretrained(tmp_path)
    assert processor == MoonViTImageProcessor(in_token_limit=16384)
    plan = processor.plan_image(27, 29)
    assert (plan.box, plan.stretched_size, plan.grid_hw) == ((0, 0, 28, 56), None, (4, 2))
