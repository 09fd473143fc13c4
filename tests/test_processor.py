"""MoonViTImageProcessor against Pillow and hand computation."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from PIL import ExifTags, Image, ImageOps

from moonvit import CheckpointError
from moonvit.media.processor import (
    CONFIG_NAME,
    ImageLoadError,
    ImageTooLargeError,
    MoonViTImageProcessor,
    image_size,
    load_image,
    patchify,
    unpatchify,
)

P = 14
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def random_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def reference_pixel_values(
    image: Image.Image,
    resized: tuple[int, int],
    grid: tuple[int, int],
    mean: tuple[float, ...] = (0.5, 0.5, 0.5),
    std: tuple[float, ...] = (0.5, 0.5, 0.5),
) -> np.ndarray:
    """Kimi-VL's pipeline written out: Pillow bicubic, black bottom/right padding, (x/255 - m)/s,
    then a Python loop cutting patches row by row. Returns (rows * cols, 3, 14, 14) float32."""
    rgb = image.convert("RGB")
    if rgb.size != resized:
        rgb = rgb.resize(resized, Image.Resampling.BICUBIC)
    rows, cols = grid
    canvas = np.zeros((rows * P, cols * P, 3), np.uint8)
    canvas[: rgb.height, : rgb.width] = np.asarray(rgb)
    x = (canvas.astype(np.float32) / np.float32(255) - np.float32(mean)) / np.float32(std)
    patches = [x[r * P : (r + 1) * P, c * P : (c + 1) * P].transpose(2, 0, 1) for r in range(rows) for c in range(cols)]
    return np.stack(patches)


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


# ---- grid rule --------------------------------------------------------------------------------

# (width, height, in_token_limit, resized (w, h), grid (rows, cols)), worked out by hand:
# n = (W // 14) * (H // 14); if n > limit, s = sqrt(limit / n) and the size is (int(W s), int(H s));
# then each side is padded up to a multiple of 28 px, grid = padded / 14.
GRID_TABLE = [
    (1, 1, 4096, (1, 1), (2, 2)),  # n = 0: no resize; 1 px -> 28 px
    (27, 29, 4096, (27, 29), (4, 2)),  # n = 1 * 2; 27 -> 28, 29 -> 56
    (28, 28, 4096, (28, 28), (2, 2)),
    (896, 896, 4096, (896, 896), (64, 64)),  # n = 64 * 64 = 4096 is not over the limit
    # n = 285 * 214 = 60990, s = 0.2591494: 1036.6 x 777.4 -> 1036 x 777 -> 1036 x 784 (4144 patches:
    # padding pushes the count over the limit, as upstream)
    (4000, 3000, 4096, (1036, 777), (56, 74)),
    # Kimi-VL-A3B-Thinking-2506's limit: s = 0.5182988: 2073.2 x 1554.9 -> 2073 x 1554 -> 2100 x 1568
    (4000, 3000, 16384, (2073, 1554), (112, 150)),
    # n = 714 * 14 = 9996, s = 0.6401280: 6401.3 x 128.03 -> 6401 x 128 -> 6412 x 140
    (10000, 200, 4096, (6401, 128), (10, 458)),
    # n = 21 * 500 = 10500, s = 0.6245761: 187.4 x 4372.03 -> 187 x 4372 -> 196 x 4396
    (300, 7000, 4096, (187, 4372), (314, 14)),
    # n = 21 * 14 = 294, s = 0.4665694: 139.97 x 93.3 -> 139 x 93 -> 140 x 112
    (300, 200, 64, (139, 93), (8, 10)),
]


@pytest.mark.parametrize("width, height, limit, resized, grid", GRID_TABLE)
def test_plan_follows_the_rule(width, height, limit, resized, grid):
    plan = MoonViTImageProcessor(in_token_limit=limit).plan_image(width, height)
    assert plan.resized_size == resized
    assert plan.grid_hw == grid
    assert plan.box == (0, 0, grid[1] * P, grid[0] * P)
    assert plan.num_patches == grid[0] * grid[1]


def test_per_image_limit_override():
    processor = MoonViTImageProcessor()
    assert processor.plan_image(300, 200, in_token_limit=64).grid_hw == (8, 10)
    assert processor.plan_image(300, 200).grid_hw == (16, 22)  # 294 <= 4096: pad 308 x 224


def test_never_upscales():
    plan = MoonViTImageProcessor(in_token_limit=16384).plan_image(100, 60)
    assert plan.resized_size == (100, 60)
    assert plan.grid_hw == (6, 8)


def test_side_over_512_patches_is_refused_by_default():
    # 571 * 1 patches is within budget, but 8000 px pads to 8008 = 572 patches wide
    with pytest.raises(ValueError, match="2x572 patch grid.*position table"):
        MoonViTImageProcessor().plan_image(8000, 14)
    with pytest.raises(ValueError, match="position table"):
        MoonViTImageProcessor(in_token_limit=16384).plan_image(10000, 200)  # 9996 <= 16384: no resize
    assert MoonViTImageProcessor().plan_image(7168, 28).grid_hw == (2, 512)  # exactly 512 fits


@pytest.mark.parametrize(
    "width, height, limit, resized, grid",
    [
        # s = min(1, sqrt(4096/571), 7168/8000, 7168/14) = 0.896: 7168 x int(12.54) -> pad 7168 x 28
        (8000, 14, 4096, (7168, 12), (2, 512)),
        # s = min(1, sqrt(16384/9996), 7168/10000, 7168/200) = 0.7168: 7168 x int(143.4) -> 7168 x 168
        (10000, 200, 16384, (7168, 143), (12, 512)),
        # the budget term still wins when it is smaller: same as the table above
        (10000, 200, 4096, (6401, 128), (10, 458)),
        (300, 7000, 4096, (187, 4372), (314, 14)),
    ],
)
def test_side_cap_option_follows_kimi_k25(width, height, limit, resized, grid):
    processor = MoonViTImageProcessor(in_token_limit=limit, side_limit_mode="resize")
    plan = processor.plan_image(width, height)
    assert (plan.resized_size, plan.grid_hw) == (resized, grid)


# ---- pixels -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, limit, resized, grid, mean, std",
    [
        ((300, 200), 64, (139, 93), (8, 10), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # resized and padded
        ((45, 31), 4096, (45, 31), (4, 4), CLIP_MEAN, CLIP_STD),  # padded only
        ((56, 28), 4096, (56, 28), (2, 4), CLIP_MEAN, CLIP_STD),  # neither
    ],
)
def test_pixel_values_match_pillow_and_hand_normalisation(size, limit, resized, grid, mean, std):
    image = random_rgb(*size)
    processor = MoonViTImageProcessor(in_token_limit=limit, image_mean=mean, image_std=std)
    batch = processor(image)
    assert batch.pixel_values.dtype == torch.float32
    assert batch.grid_hws.dtype == torch.int64
    assert batch.grid_hws.tolist() == [list(grid)]
    expected = reference_pixel_values(image, resized, grid, mean, std)
    assert torch.equal(batch.pixel_values, torch.from_numpy(expected))


def test_padding_is_black_before_normalisation():
    batch = MoonViTImageProcessor()(Image.new("RGB", (1, 1), (255, 255, 255)))
    image = batch.pixel_values.reshape(2, 2, 3, P, P).permute(2, 0, 3, 1, 4).reshape(3, 28, 28)
    assert torch.all(image[:, 0, 0] == 1.0)  # (255/255 - 0.5) / 0.5
    image[:, 0, 0] = -1.0
    assert torch.all(image == -1.0)  # (0/255 - 0.5) / 0.5 everywhere else


def test_batch_concatenates_images_in_order():
    images = [random_rgb(30, 40, seed=1), random_rgb(300, 200, seed=2), random_rgb(14, 14, seed=3)]
    batch = MoonViTImageProcessor(in_token_limit=64)(images)
    grids = [(4, 4), (8, 10), (2, 2)]
    assert batch.grid_hws.tolist() == [list(g) for g in grids]
    resized = [(30, 40), (139, 93), (14, 14)]
    expected = np.concatenate([reference_pixel_values(im, r, g) for im, r, g in zip(images, resized, grids)])
    assert torch.equal(batch.pixel_values, torch.from_numpy(expected))


def test_to_images_inverts_the_processor():
    images = [random_rgb(300, 200, seed=4), random_rgb(45, 31, seed=5)]
    processor = MoonViTImageProcessor(in_token_limit=64, image_mean=CLIP_MEAN, image_std=CLIP_STD)
    batch = processor(images)
    restored = processor.to_images(batch.pixel_values, batch.grid_hws)
    for image, resized, output in zip(images, [(139, 93), (45, 31)], restored):
        expected = np.zeros((output.shape[1], output.shape[2], 3), np.uint8)
        expected[: resized[1], : resized[0]] = pixels(image.resize(resized, Image.Resampling.BICUBIC))
        assert torch.equal(output.permute(1, 2, 0), torch.from_numpy(expected))


def test_patchify_is_raster_order_and_unpatchify_inverts_it():
    image = torch.randn(3, 3 * P, 4 * P)
    patches = patchify(image, P)
    assert patches.shape == (12, 3, P, P)
    for k in range(12):
        r, c = divmod(k, 4)
        assert torch.equal(patches[k], image[:, r * P : (r + 1) * P, c * P : (c + 1) * P])
    assert torch.equal(unpatchify(patches, (3, 4)), image)
    with pytest.raises(ValueError, match="multiple"):
        patchify(torch.zeros(3, 15, 14), P)
    with pytest.raises(ValueError, match="do not fill"):
        unpatchify(patches, (3, 3))


def test_pad_input_false_centre_crops_to_merge_multiples():
    image = random_rgb(70, 45)
    processor = MoonViTImageProcessor(pad_input=False)
    plan = processor.plan_image(70, 45)
    assert plan.box == (7, 8, 63, 36)  # 56 x 28 centred: (70 - 56) // 2, (45 - 28) // 2
    assert plan.grid_hw == (2, 4)
    expected = reference_pixel_values(image.crop(plan.box), (56, 28), (2, 4))
    assert torch.equal(processor(image).pixel_values, torch.from_numpy(expected))
    with pytest.raises(ValueError, match="smaller than one merged token"):
        processor.plan_image(20, 50)


def test_single_image_and_empty_list():
    processor = MoonViTImageProcessor()
    image = random_rgb(30, 30)
    single, listed = processor(image), processor([image])
    assert torch.equal(single.pixel_values, listed.pixel_values)
    assert torch.equal(single.grid_hws, listed.grid_hws)
    empty = processor([])
    assert empty.pixel_values.shape == (0, 3, P, P)
    assert empty.grid_hws.shape == (0, 2)
    with pytest.raises(ValueError, match="2 in_token_limit values for 1 images"):
        processor([image], in_token_limit=[None, 64])


# ---- input kinds ------------------------------------------------------------------------------


def test_every_input_kind_gives_the_same_pixels(tmp_path):
    image = random_rgb(37, 23)
    array = np.array(image)
    path = tmp_path / "image.png"
    image.save(path)
    inputs = {
        "pil": image,
        "numpy_hwc_uint8": array,
        "numpy_non_contiguous": np.asfortranarray(array),
        "tensor_chw_uint8": torch.from_numpy(array).permute(2, 0, 1),
        "tensor_chw_float01": torch.from_numpy(array).permute(2, 0, 1).double() / 255,
        "str_path": str(path),
        "pathlib_path": path,
    }
    expected = reference_pixel_values(image, (37, 23), (2, 4))
    processor = MoonViTImageProcessor()
    for kind, source in inputs.items():
        assert image_size(source) == (37, 23), kind
        assert torch.equal(processor(source).pixel_values, torch.from_numpy(expected)), kind


def test_grayscale_and_rgba_arrays():
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, (20, 30), dtype=np.uint8)
    expected = pixels(Image.fromarray(gray))
    for source in (gray, gray[:, :, None], torch.from_numpy(gray), torch.from_numpy(gray)[None]):
        assert np.array_equal(np.asarray(load_image(source)), expected)
    rgba = rng.integers(0, 256, (20, 30, 4), dtype=np.uint8)
    expected = np.asarray(load_image(Image.fromarray(rgba)))
    assert np.array_equal(np.asarray(load_image(rgba)), expected)
    assert np.array_equal(np.asarray(load_image(torch.from_numpy(rgba).permute(2, 0, 1))), expected)


@pytest.mark.parametrize(
    "source, message",
    [
        (np.zeros((8, 8, 3), np.bool_), "must be uint8.*or floating.*bool"),
        (np.zeros((8, 8, 3), np.uint16), "must be uint8.*uint16"),
        (np.zeros((8, 8, 2), np.uint8), r"C in \(1, 3, 4\).*\(8, 8, 2\)"),
        (np.zeros((1, 2, 8, 8, 3), np.uint8), r"shape \(2, 8, 8, 3\)"),  # a batch of one 4-D array
        (np.zeros((0, 8, 3), np.uint8), "zero size"),
        (torch.zeros(5, 8, 8, dtype=torch.uint8), r"C in \(1, 3, 4\)"),
        (torch.zeros(8, 8, 3, dtype=torch.uint8), r"\(C, H, W\).*\(8, 8, 3\)"),
        (torch.zeros(3, 8, 8, dtype=torch.int64), "uint8.*or floating.*int64"),
        (torch.full((3, 8, 8), 1.5), r"\[0, 1\].*1\.5"),
        (torch.full((3, 8, 8), -0.1), r"\[0, 1\]"),
        (torch.full((3, 8, 8), float("nan")), r"\[0, 1\]"),
        (torch.zeros(3, 0, 8), "zero size"),
        (Image.new("RGB", (0, 4)), "zero size"),
        (b"\x89PNG", "unsupported image type bytes"),
        (42, "unsupported image type int"),
    ],
)
def test_bad_in_memory_inputs_raise_clear_errors(source, message):
    with pytest.raises(ImageLoadError, match=message):
        MoonViTImageProcessor()(source)


def test_image_load_error_is_a_value_error():
    assert issubclass(ImageLoadError, ValueError)
    assert issubclass(ImageTooLargeError, ImageLoadError)


# ---- files ------------------------------------------------------------------------------------


def test_unreadable_files_name_the_file(tmp_path):
    missing = tmp_path / "missing.png"
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not an image")
    for path in (missing, not_an_image):
        for read in (image_size, load_image):
            with pytest.raises(ImageLoadError, match="notes.png|missing.png"):
                read(path)


def test_truncated_file_is_planned_from_its_header_but_fails_to_decode(tmp_path):
    path = tmp_path / "truncated.jpg"
    random_rgb(64, 48).save(path, quality=95)
    path.write_bytes(path.read_bytes()[:-400])
    assert image_size(path) == (64, 48)  # header only: no decoding yet
    with pytest.raises(ImageLoadError, match="cannot decode image file.*truncated.jpg"):
        MoonViTImageProcessor()(path)


def test_decompression_bombs_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    over_twice, over_once = tmp_path / "big.png", tmp_path / "medium.png"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        random_rgb(20, 20).save(over_twice)  # 400 px: Pillow's DecompressionBombError
        random_rgb(12, 12).save(over_once)  # 144 px: Pillow only warns; refused here
    for path in (over_twice, over_once):
        for read in (image_size, load_image):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with pytest.raises(ImageTooLargeError, match=path.name):
                    read(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert image_size(over_twice) == (20, 20)


@pytest.mark.parametrize(
    "orientation, size, grid", [(3, (40, 20), (2, 4)), (6, (20, 40), (4, 2)), (8, (20, 40), (4, 2))]
)
def test_exif_orientation_is_applied(tmp_path, orientation, size, grid):
    path = tmp_path / "photo.jpg"
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    random_rgb(40, 20).save(path, exif=exif, quality=95)
    with Image.open(path) as opened:
        expected = pixels(ImageOps.exif_transpose(opened))
    assert expected.shape[1::-1] == size
    assert image_size(path) == size
    for source in (path, Image.open(path)):
        assert np.array_equal(np.asarray(load_image(source)), expected)
    batch = MoonViTImageProcessor()(path)
    expected_values = reference_pixel_values(Image.fromarray(expected), size, grid)
    assert torch.equal(batch.pixel_values, torch.from_numpy(expected_values))


# ---- Pillow modes -----------------------------------------------------------------------------


def test_rgba_composites_over_the_background_by_default():
    rgba = np.zeros((1, 3, 4), np.uint8)
    rgba[0, :, :3] = [[200, 100, 50]] * 3
    rgba[0, :, 3] = [0, 255, 128]
    image = Image.fromarray(rgba)
    white = np.asarray(load_image(image)).astype(int)[0]
    assert white[0].tolist() == [255, 255, 255]  # fully transparent: background
    assert white[1].tolist() == [200, 100, 50]  # opaque: unchanged
    blend = (np.array([200, 100, 50]) * 128 + 255 * 127) / 255
    assert np.abs(white[2] - blend).max() <= 1
    custom = np.asarray(load_image(image, background_color=(0, 128, 255))).astype(int)[0]
    assert custom[0].tolist() == [0, 128, 255]
    processor = MoonViTImageProcessor(background_color=(0, 128, 255))
    assert np.array_equal(np.asarray(processor.load_image(image))[0], custom)


def test_drop_alpha_mode_matches_upstream_convert():
    rng = np.random.default_rng(1)
    for image in (
        Image.fromarray(rng.integers(0, 256, (6, 5, 4), dtype=np.uint8)),  # RGBA
        Image.fromarray(rng.integers(0, 256, (6, 5, 4), dtype=np.uint8)).convert("LA"),
    ):
        dropped = load_image(image, alpha_mode="drop")
        assert np.array_equal(np.asarray(dropped), pixels(image))


def test_la_and_palette_transparency():
    la = Image.fromarray(np.array([[[90, 0], [90, 255]]], np.uint8), mode="LA")
    assert np.asarray(load_image(la))[0].tolist() == [[255, 255, 255], [90, 90, 90]]
    palette = Image.new("P", (2, 1))
    palette.putpalette([10, 20, 30, 40, 50, 60])
    palette.putpixel((0, 0), 0)
    palette.putpixel((1, 0), 1)
    palette.info["transparency"] = 0
    assert np.asarray(load_image(palette, background_color=(1, 2, 3)))[0].tolist() == [[1, 2, 3], [40, 50, 60]]
    assert np.asarray(load_image(palette, alpha_mode="drop"))[0].tolist() == [[10, 20, 30], [40, 50, 60]]


def test_palette_png_with_transparency_from_file(tmp_path):
    palette = Image.new("P", (2, 1))
    palette.putpalette([10, 20, 30, 40, 50, 60])
    palette.putpixel((1, 0), 1)
    path = tmp_path / "palette.png"
    palette.save(path, transparency=0)
    assert np.asarray(load_image(path))[0].tolist() == [[255, 255, 255], [40, 50, 60]]


@pytest.mark.parametrize("mode", ["1", "L", "P", "CMYK", "YCbCr", "HSV", "LAB", "RGBX"])
def test_8_bit_modes_use_pillow_conversion(mode):
    image = random_rgb(9, 7).convert(mode)
    assert np.array_equal(np.asarray(load_image(image)), pixels(image))


def test_16_bit_modes_are_scaled_not_clipped(tmp_path):
    values = np.array([[0, 128, 129, 32768, 65535]], np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    path = tmp_path / "sixteen.png"
    image.save(path)
    for source in (image, path):
        # round(v * 255 / 65535): 0, 0.498, 0.502, 127.502, 255
        assert np.asarray(load_image(source))[0, :, 0].tolist() == [0, 0, 1, 128, 255]


# ---- configuration ----------------------------------------------------------------------------


def test_defaults_without_a_config_file(tmp_path):
    assert MoonViTImageProcessor.from_pretrained(tmp_path) == MoonViTImageProcessor()
    processor = MoonViTImageProcessor()
    assert (processor.patch_size, processor.merge_kernel_size, processor.in_token_limit) == (14, (2, 2), 4096)
    assert processor.pad_input is True
    assert processor.image_mean == processor.image_std == (0.5, 0.5, 0.5)
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        MoonViTImageProcessor.from_pretrained(tmp_path / "nowhere")


def test_reads_a_kimi_vl_config_with_unknown_keys(tmp_path):
    config = {
        "auto_map": {"AutoImageProcessor": "image_processing_kimi_vl.KimiVLImageProcessor"},
        "image_processor_type": "KimiVLImageProcessor",
        "processor_class": "KimiVLProcessor",
        "in_token_limit": 16384,
        "merge_kernel_size": [2, 2],
        "num_pooled_tokens": 1024,
        "pad_input": True,
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    expected = MoonViTImageProcessor(in_token_limit=16384)
    assert MoonViTImageProcessor.from_pretrained(tmp_path) == expected
    assert MoonViTImageProcessor.from_pretrained(tmp_path / CONFIG_NAME) == expected
    overridden = MoonViTImageProcessor.from_pretrained(tmp_path, in_token_limit=4096, alpha_mode="drop")
    assert (overridden.in_token_limit, overridden.alpha_mode) == (4096, "drop")


def test_settings_round_trip(tmp_path):
    processor = MoonViTImageProcessor(
        patch_size=16,
        merge_kernel_size=(2, 1),
        in_token_limit=1000,
        pad_input=False,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        patch_limit_on_one_side=256,
        side_limit_mode="resize",
        alpha_mode="drop",
        background_color=(1, 2, 3),
    )
    path = processor.save_pretrained(tmp_path / "out")
    assert path == tmp_path / "out" / CONFIG_NAME
    saved = json.loads(path.read_text())
    assert saved["merge_kernel_size"] == [2, 1]
    assert saved["image_processor_type"] == "MoonViTImageProcessor"
    assert MoonViTImageProcessor.from_pretrained(path.parent) == processor


@pytest.mark.parametrize(
    "field, value",
    [
        ("patch_size", 0),
        ("in_token_limit", -1),
        ("merge_kernel_size", (2, 2, 2)),
        ("image_std", (0.5, 0.0, 0.5)),
        ("image_mean", (0.5, 0.5)),
        ("alpha_mode", "keep"),
        ("side_limit_mode", "clamp"),
        ("background_color", (0, 0, 256)),
        ("pad_input", "yes"),
        ("patch_limit_on_one_side", 1),
    ],
)
def test_invalid_settings_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        MoonViTImageProcessor(**{field: value})


# ---- with the encoder -------------------------------------------------------------------------


def test_end_to_end_equals_encoder_on_hand_built_pixel_values(tmp_path):
    from moonvit.model import MoonViT

    encoder = MoonViT.from_preset("tiny").eval()
    images = [random_rgb(300, 200, seed=7), random_rgb(27, 29, seed=8), random_rgb(45, 31, seed=9)]
    images[1].save(tmp_path / "b.png")
    sources = [images[0], tmp_path / "b.png", np.asarray(images[2])]
    resized = [(139, 93), (27, 29), (45, 31)]
    grids = [(8, 10), (4, 2), (4, 4)]
    hand_built = np.concatenate([reference_pixel_values(im, r, g) for im, r, g in zip(images, resized, grids)])
    with torch.no_grad():
        expected = encoder(torch.from_numpy(hand_built), torch.tensor(grids))
        batch = MoonViTImageProcessor(in_token_limit=64)(sources)
        actual = encoder(batch.pixel_values, batch.grid_hws)
    assert torch.equal(actual.last_hidden_state, expected.last_hidden_state)
    assert torch.equal(actual.merged, expected.merged)
    assert actual.merged.shape == ((80 + 8 + 16) // 4, 4, encoder.config.hidden_size)
