"""Token-budget packing and encode_images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from moonvit.encode import EncodedImage, encode_images, iter_encode_images
from moonvit.media.packing import pack_images
from moonvit.media.processor import ImageLoadError, MoonViTImageProcessor
from moonvit.model import MoonViT


@pytest.fixture(scope="module")
def encoder() -> MoonViT:
    torch.manual_seed(0)
    return MoonViT.from_preset("tiny").eval()


def gray(width: int, height: int, value: int = 0) -> np.ndarray:
    return np.full((height, width), value, np.uint8)


def noise(width: int, height: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# Padded grids at the default in_token_limit: 28 px -> 2 patches, 29..56 px -> 4, 57..84 px -> 6.
SIZES = [(28, 28), (56, 56), (84, 28), (30, 30), (84, 84), (28, 28), (56, 84), (10, 10)]
PATCHES = [4, 16, 12, 16, 36, 4, 24, 4]


def test_packs_fit_the_budget_in_input_order():
    processor = MoonViTImageProcessor()
    packs = list(pack_images([gray(w, h) for w, h in SIZES], processor, max_patches_per_pack=40))
    # greedy by hand: 4+16+12 = 32 (+16 > 40) | 16 (+36 > 40) | 36+4 = 40 (+24 > 40) | 24+4
    assert [pack.indices for pack in packs] == [[0, 1, 2], [3], [4, 5], [6, 7]]
    assert [pack.num_patches for pack in packs] == [32, 16, 40, 28]
    for pack in packs:
        assert [item.plan.num_patches for item in pack.items] == [PATCHES[i] for i in pack.indices]
        assert not any(item.rescaled for item in pack.items)
        batch = processor([item.source for item in pack.items])
        assert batch.pixel_values.shape[0] == pack.num_patches


def test_an_image_over_the_budget_is_scaled_to_fit_after_padding():
    processor = MoonViTImageProcessor()
    # 300 x 200 pads to 308 x 224 = 22 x 16 = 352 patches. Asking the rule for 100 tokens is not
    # enough: 174 x 116 px pads to 196 x 140 = 140 patches.
    assert processor.plan_image(300, 200, in_token_limit=100).num_patches == 140
    (pack,) = pack_images([noise(300, 200, 0)], processor, max_patches_per_pack=100)
    (item,) = pack.items
    assert item.rescaled
    assert item.plan.num_patches <= 100
    assert processor.plan_image(300, 200, in_token_limit=item.in_token_limit + 1).num_patches > 100
    batch = processor(item.source, in_token_limit=item.in_token_limit)
    assert batch.pixel_values.shape[0] == item.plan.num_patches
    assert batch.grid_hws.tolist() == [list(item.plan.grid_hw)]


def test_budget_errors():
    processor = MoonViTImageProcessor()
    with pytest.raises(ValueError, match="at least one merged token"):
        list(pack_images([gray(28, 28)], processor, max_patches_per_pack=3))
    # 2000 x 14 px shrinks at most to 167 x 1 px, which still pads to 168 x 28 = 24 patches
    with pytest.raises(ValueError, match="at least 24 patches"):
        list(pack_images([gray(2000, 14)], processor, max_patches_per_pack=8))


def test_bad_input_error_gives_its_position():
    images = [gray(28, 28), gray(28, 28), np.zeros((28, 28), np.int32)]
    with pytest.raises(ImageLoadError, match="input image 2: numpy images must be uint8"):
        list(pack_images(images, MoonViTImageProcessor()))
    with pytest.raises(ValueError, match="input image 1: a 8000x14 image .* position table"):
        list(pack_images([gray(28, 28), gray(8000, 14)], MoonViTImageProcessor()))


def test_files_are_planned_from_headers_without_decoding(tmp_path, monkeypatch):
    paths = []
    for i, (w, h) in enumerate(SIZES):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(noise(w, h, i)).save(paths[-1])

    def refuse(self):
        raise AssertionError("decoded during planning")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    packs = list(pack_images(paths, MoonViTImageProcessor(), max_patches_per_pack=40))
    assert [item.plan.num_patches for pack in packs for item in pack.items] == PATCHES


def test_input_is_consumed_lazily(encoder):
    pulled = []

    def images():
        for i in range(20):
            pulled.append(i)
            yield gray(56, 56, i)  # 16 patches each: 4 images per 64-patch pack

    results = iter_encode_images(encoder, MoonViTImageProcessor(), images(), max_patches_per_pack=64)
    first = next(results)
    assert first.index == 0
    assert len(pulled) == 5  # the first pack and the one image that closed it
    assert [r.index for r in results] == list(range(1, 20))


def test_encoder_never_sees_more_than_the_budget(encoder, monkeypatch):
    seen = []
    forward = encoder.forward

    def spy(pixel_values, grid_thws=None, **kwargs):
        seen.append(pixel_values.shape[0])
        return forward(pixel_values, grid_thws, **kwargs)

    monkeypatch.setattr(encoder, "forward", spy)
    images = [noise(*SIZES[i % len(SIZES)], seed=i) for i in range(60)] + [noise(300, 200, 60)]
    with pytest.warns(UserWarning, match=r"1 of 61 images were scaled down .* \(inputs 60\)"):
        tokens = encode_images(encoder, MoonViTImageProcessor(), images, max_patches_per_pack=100)
    assert len(tokens) == 61
    assert max(seen) <= 100
    assert sum(seen) == sum(4 * t.shape[0] for t in tokens)


def test_encode_images_equals_encoding_each_image_alone(encoder, tmp_path):
    processor = MoonViTImageProcessor()
    Image.fromarray(noise(45, 31, 1)).save(tmp_path / "a.png")
    images = [noise(30, 40, 0), tmp_path / "a.png", Image.fromarray(noise(300, 200, 2)), str(tmp_path / "a.png")]
    results = list(iter_encode_images(encoder, processor, images, max_patches_per_pack=100))
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert [r.rescaled for r in results] == [False, False, True, False]
    limits = [None, None, _fitted_limit(processor, 300, 200, 100), None]
    for result, image, limit in zip(results, images, limits):
        batch = processor(image, in_token_limit=limit)
        with torch.no_grad():
            alone = encoder(batch.pixel_values, batch.grid_hws).merged
        rows, cols = result.grid_hw
        assert [rows, cols] == batch.grid_hws[0].tolist()
        assert result.tokens.shape == (rows * cols // 4, 4, encoder.config.hidden_size)
        torch.testing.assert_close(result.tokens, alone, rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning, match=r"\(inputs 2\)"):
        listed = encode_images(encoder, processor, images, max_patches_per_pack=100)
    assert all(torch.equal(a, r.tokens) for a, r in zip(listed, results))


def _fitted_limit(processor: MoonViTImageProcessor, width: int, height: int, budget: int) -> int:
    """The largest limit whose padded grid fits, by brute force."""
    return max(n for n in range(1, 4097) if processor.plan_image(width, height, in_token_limit=n).num_patches <= budget)


def test_results_go_to_the_output_device_without_autograd(encoder):
    (result,) = iter_encode_images(encoder, MoonViTImageProcessor(), [gray(28, 56)], output_device="meta")
    assert isinstance(result, EncodedImage)
    assert result.tokens.device.type == "meta"
    assert result.tokens.shape == (2, 4, encoder.config.hidden_size)
    (tokens,) = encode_images(encoder, MoonViTImageProcessor(), gray(28, 56))
    assert tokens.device.type == "cpu"
    assert not tokens.requires_grad


def test_a_single_path_is_one_image(encoder, tmp_path):
    path = tmp_path / "one.png"
    Image.fromarray(noise(20, 20, 0)).save(path)
    assert len(encode_images(encoder, MoonViTImageProcessor(), str(path))) == 1


def test_encode_images_flags_each_image_scaled_to_fit_and_warns_once(encoder):
    processor = MoonViTImageProcessor()
    images = [gray(28, 28), noise(300, 200, 1), gray(56, 28), noise(400, 400, 2)]
    with pytest.warns(UserWarning) as caught:
        result = encode_images(encoder, processor, images, max_patches_per_pack=64)
    assert len(caught) == 1
    assert "2 of 4 images were scaled down to fit max_patches_per_pack=64 (inputs 1, 3)" in str(caught[0].message)
    assert result.rescaled == [False, True, False, True]
    for tokens, grid, image in zip(result, result.grid_hws, images):
        own = processor.plan_image(image.shape[1], image.shape[0]).grid_hw  # the processor alone
        assert len(tokens) == grid[0] * grid[1] // 4 and grid[0] * grid[1] <= 64
        assert (grid != own) == (own[0] * own[1] > 64)
    assert isinstance(result, list) and all(isinstance(t, torch.Tensor) for t in result)


def test_encode_images_is_silent_when_nothing_is_scaled(encoder):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = encode_images(encoder, MoonViTImageProcessor(), [gray(300, 200)], max_patches_per_pack=4096)
    assert result.rescaled == [False] and result.grid_hws == [(16, 22)]
