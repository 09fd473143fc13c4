"""Every Pillow mode, sample type and in-memory input kind: converted from its real range or refused."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_close_across_shapes
from PIL import Image

from moonvit import MoonViT, MoonViTImageProcessor, encode_images
from moonvit.media.image import ImageLoadError, ImageTooLargeError, ImageWarning, image_size, load_image


def write_tiff(path: Path, values: np.ndarray, sample_format: int, min_max: tuple[float, float] | None = None) -> Path:
    """A one-strip, uncompressed, single-band little-endian TIFF written by hand (an independent
    writer: Pillow cannot save 16-bit signed or 32-bit unsigned samples). ``sample_format``: 1
    unsigned, 2 signed, 3 float; ``min_max``: SMinSampleValue / SMaxSampleValue as doubles."""
    height, width = values.shape
    data = values.astype(values.dtype.newbyteorder("<")).tobytes()
    bits = values.dtype.itemsize * 8
    extra = b""
    entries = [
        (256, 4, 1, width),  # ImageWidth, LONG
        (257, 4, 1, height),  # ImageLength
        (258, 3, 1, bits),  # BitsPerSample, SHORT
        (259, 3, 1, 1),  # Compression: none
        (262, 3, 1, 1),  # PhotometricInterpretation: black is zero
        (273, 4, 1, 0),  # StripOffsets (patched below)
        (277, 3, 1, 1),  # SamplesPerPixel
        (278, 4, 1, height),  # RowsPerStrip
        (279, 4, 1, len(data)),  # StripByteCounts
        (339, 3, 1, sample_format),  # SampleFormat
    ]
    if min_max is not None:
        entries += [(340, 12, 1, 0), (341, 12, 1, 8)]  # DOUBLE values, offsets patched below
        extra = struct.pack("<dd", *min_max)
    ifd_size = 2 + 12 * len(entries) + 4
    data_offset = 8 + ifd_size
    extra_offset = data_offset + len(data)
    ifd = struct.pack("<H", len(entries))
    for tag, kind, count, value in entries:
        if tag == 273:
            value = data_offset
        if tag in (340, 341):
            value += extra_offset
        packed = struct.pack("<H", value) + b"\0\0" if kind == 3 else struct.pack("<I", value)
        ifd += struct.pack("<HHI", tag, kind, count) + packed
    path.write_bytes(b"II*\0" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + data + extra)
    return path


def gray(image: Image.Image) -> list[int]:
    """The first row of the decoded image, one value per pixel (the image is gray)."""
    rgb = np.asarray(image)
    assert (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()
    return rgb[0, :, 0].tolist()


def reference(values: list[float], low: float, high: float) -> list[int]:
    """round((v - low) / (high - low) * 255), half up, computed in exact fractions."""
    from fractions import Fraction

    return [int(Fraction(v - low) / Fraction(high - low) * 255 + Fraction(1, 2)) for v in values]


# ---- files with a declared range --------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, sample_format, values, low, high",
    [
        (np.int16, 2, [-32768, -1, 0, 12345, 32767], -32768, 32767),
        (np.uint32, 1, [0, 1, 2**31, 2**32 - 1], 0, 2**32 - 1),
        (np.int32, 2, [-(2**31), 0, 2**30, 2**31 - 1], -(2**31), 2**31 - 1),
    ],
)
def test_integer_tiffs_use_their_sample_type_range(tmp_path, dtype, sample_format, values, low, high):
    path = write_tiff(tmp_path / "int.tif", np.array([values], dtype), sample_format)
    assert Image.open(path).mode == "I"
    assert gray(load_image(path)) == reference(values, low, high)


def test_a_picture_the_range_rule_leaves_flat_is_named_in_a_warning(tmp_path):
    """16-bit data (0..65535) in signed 32-bit samples fills 0.0015% of the declared range: the rule
    maps it to one grey level; that must not pass silently."""
    values = np.arange(0, 65536, 257, dtype=np.int32).reshape(16, 16)
    path = write_tiff(tmp_path / "scan.tif", values, 2)
    with pytest.warns(
        ImageWarning,
        match=r"scan\.tif.*mode 'I' values 0\.\.65535 fill 0\.002% of the range "
        r"-2147483648\.\.2147483647 .* keeps 1 of 256 grey levels",
    ):
        flat = np.asarray(load_image(path))
    assert flat.std() == 0  # the rule is kept; the warning is what changed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a picture that keeps its contrast, and a constant one, say nothing
        load_image(write_tiff(tmp_path / "full.tif", np.array([[-(2**31), 2**31 - 1]], np.int32), 2))
        load_image(write_tiff(tmp_path / "flat.tif", np.zeros((4, 4), np.int32), 2))


@pytest.mark.parametrize("suffix", [".gif", ".webp", ".png"])
def test_an_animated_file_gives_its_first_frame_with_a_warning(tmp_path, suffix):
    frames = [Image.new("RGB", (24, 16), (60 * i, 100, 200)) for i in range(3)]
    path = tmp_path / f"anim{suffix}"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, lossless=True)
    with pytest.warns(ImageWarning, match=rf"anim\{suffix}' is animated \(3 frames"):
        first = np.asarray(load_image(path))
    assert np.abs(first.astype(int) - np.asarray(frames[0]).astype(int)).max() <= 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frames[0].save(tmp_path / f"still{suffix}")
        load_image(tmp_path / f"still{suffix}")


def test_tiff_min_max_tags_set_the_range(tmp_path):
    ints = write_tiff(tmp_path / "i.tif", np.array([[0, 1000, 2000, 4095, 5000]], np.int32), 2, (0, 4095))
    assert gray(load_image(ints)) == [0, 62, 125, 255, 255]  # 12-bit data in 32-bit samples; over 4095 clipped
    floats = write_tiff(tmp_path / "f.tif", np.array([[-1.0, 0.0, 1.0, 3.0]], np.float32), 3, (-1.0, 3.0))
    assert gray(load_image(floats)) == reference([-1, 0, 1, 3], -1, 3)


def test_float_tiffs_are_read_as_zero_to_one(tmp_path):
    values = [0.0, 0.25, 0.5, 1.0]
    path = tmp_path / "f.tif"
    Image.fromarray(np.array([values], np.float32)).save(path)  # Pillow's own float TIFF
    assert Image.open(path).mode == "F"
    assert gray(load_image(path)) == reference(values, 0, 1)
    for bad, shown in ((np.array([[0.0, 0.5, 255.0]], np.float32), "255.0"), (np.array([[0.0, np.nan]]), "nan")):
        Image.fromarray(bad.astype(np.float32)).save(path)
        with pytest.raises(ImageLoadError, match=rf"f\.tif.*Pillow mode 'F'.*{shown}"):
            load_image(path)


@pytest.mark.parametrize("maxval", [1000, 65535])
def test_16_bit_pgm_files_use_their_maxval(tmp_path, maxval):
    values = [0, maxval // 3, maxval]
    path = tmp_path / "deep.pgm"
    path.write_bytes(f"P5 3 1 {maxval}\n".encode() + np.array(values, ">u2").tobytes())
    assert gray(load_image(path)) == reference(values, 0, maxval)


def test_32_bit_integer_images_without_a_range_are_refused_with_file_and_mode(tmp_path):
    image = Image.fromarray(np.array([[0, 5, 70000]], np.int32))
    with pytest.raises(ImageLoadError, match=r"in memory.*Pillow mode 'I' \(32-bit integer"):
        load_image(image)
    copied = Image.open(write_tiff(tmp_path / "i.tif", np.array([[0, 5]], np.int32), 2)).copy()
    with pytest.raises(ImageLoadError, match="Pillow mode 'I'"):  # a copy keeps no file tags
        load_image(copied)


# ---- every mode -------------------------------------------------------------------------------


def test_every_pillow_mode_is_converted_with_its_range_or_refused():
    """An image of each mode filled with one mid value: either its RGB is the value's place in the
    mode's range, or the error names the mode. Nothing comes out black or white."""
    expected_refusals = {"I"}  # no declared range in memory
    for mode in Image.MODES:
        if mode in ("1",):
            image = Image.new(mode, (3, 2), 1)  # 1-bit: white is its only non-black value
            assert gray(load_image(image)) == [255] * 3
            continue
        if mode == "F":
            image, want = Image.new(mode, (3, 2), 0.5), 128
        elif mode.startswith("I;16"):
            image, want = Image.new(mode, (3, 2), 32768), 128
        elif mode == "I":
            image = Image.new(mode, (3, 2), 128)
        elif mode == "La":
            image, want = Image.new(mode, (3, 2), (128, 255)), 128
        else:
            base = Image.new("L", (3, 2), 128)
            image = base.convert(mode) if mode != "RGBa" else base.convert("RGBA").convert(mode)
            want = np.asarray(image.convert("RGB"))
        if mode in expected_refusals:
            with pytest.raises(ImageLoadError, match=f"Pillow mode '{mode}'"):
                load_image(image)
            continue
        decoded = np.asarray(load_image(image, alpha_mode="drop"))
        assert decoded.shape == (2, 3, 3), mode
        if isinstance(want, int):
            assert (decoded == want).all(), (mode, decoded[0, 0])
        elif want is not None:
            assert np.array_equal(decoded, want), mode
        assert 0 < decoded.mean() < 255, mode


def test_premultiplied_la_is_unpremultiplied():
    image = Image.new("La", (2, 1), (100, 128))  # premultiplied: the stored 100 is 199 at alpha 128
    assert gray(load_image(image, alpha_mode="drop")) == [199, 199]


# ---- arrays and tensors ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_float_hwc_arrays_in_zero_to_one_equal_float_tensors(dtype):
    rng = np.random.default_rng(0)
    values = rng.random((20, 30, 3)).astype(dtype)
    values[0, :3, 0] = [0.0, 1.0, 0.5]
    from_array = np.asarray(load_image(values))
    from_tensor = np.asarray(load_image(torch.from_numpy(values.astype(np.float32)).permute(2, 0, 1)))
    assert np.array_equal(from_array, from_tensor)
    assert np.array_equal(from_array, np.rint(values.astype(np.float32) * np.float32(255)).astype(np.uint8))
    assert image_size(values) == (30, 20)
    gray_values = values[:, :, 0]
    assert np.array_equal(np.asarray(load_image(gray_values))[:, :, 0], from_array[:, :, 0])


@pytest.mark.parametrize(
    "array, shown",
    [(np.full((4, 4, 3), 1.5), "1.5"), (np.full((4, 4), -0.5), "-0.5"), (np.full((4, 4), np.nan), "nan")],
)
def test_float_arrays_outside_zero_to_one_are_refused(array, shown):
    with pytest.raises(ImageLoadError, match=rf"floating numpy images must hold values in \[0, 1\].*{shown}"):
        load_image(array)


def test_batches_and_any_iterable_are_many_images():
    rng = np.random.default_rng(1)
    batch = rng.integers(0, 256, (3, 28, 56, 3), dtype=np.uint8)
    processor = MoonViTImageProcessor()
    reference_batch = processor(list(batch))
    for images in (batch, torch.from_numpy(batch).permute(0, 3, 1, 2), tuple(batch), (image for image in batch)):
        result = processor(images)
        assert torch.equal(result.pixel_values, reference_batch.pixel_values)
        assert result.grid_hws.tolist() == [[2, 4]] * 3
    with pytest.raises(ImageLoadError, match="unsupported image type bytes"):
        processor(b"\x89PNG")


def test_encode_images_takes_any_iterable():
    encoder = MoonViT.from_preset("tiny").eval()
    processor = MoonViTImageProcessor()
    images = [np.full((28 * (i + 1), 28, 3), 40 * i, np.uint8) for i in range(3)]

    class Folder:  # a dataset-like sequence: __len__ and __getitem__ only
        def __len__(self):
            return len(images)

        def __getitem__(self, index):
            return images[index]

    expected = encode_images(encoder, processor, images)
    for source in (tuple(images), iter(images), (image for image in images), Folder()):
        got = encode_images(encoder, processor, source)  # the same pack: the same call on the same shapes
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, expected)), type(source).__name__
    # a (1, H, W, 3) batch is a pack of one image: other shapes, so float error apart from the pack of three
    (alone,) = encode_images(encoder, processor, np.stack(images[:1]))
    assert_close_across_shapes(alone, expected[0])


# ---- decompression bombs -----------------------------------------------------------------------


def test_an_oversized_file_is_one_error_that_says_how_to_raise_the_limit(tmp_path, monkeypatch):
    path = tmp_path / "wide.png"
    Image.new("RGB", (15, 10)).save(path)  # 150 px
    for limit in (100, 60):  # Pillow warns between 1x and 2x its limit, raises above
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning printed on top would fail here
            for read in (image_size, load_image):
                with pytest.raises(ImageTooLargeError, match=r"wide\.png.*PIL\.Image\.MAX_IMAGE_PIXELS = <pixels>"):
                    read(path)
