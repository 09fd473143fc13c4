"""Decoding images: any supported input to an RGB PIL image, with errors that name the input.

Inputs (:data:`ImageInput`) are PIL images, numpy arrays, tensors and file paths.
:func:`image_size` reads an input's size without decoding pixels (file headers
only), so that packs can be planned before any image is decoded;
:func:`load_image` decodes to RGB with the EXIF orientation applied.
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import torch
from PIL import ExifTags, Image

__all__ = [
    "IMAGE_EXTENSIONS",
    "AlphaMode",
    "ImageInput",
    "ImageLoadError",
    "ImageTooLargeError",
    "image_size",
    "is_image",
    "load_image",
]

IMAGE_EXTENSIONS = frozenset({".bmp", ".gif", ".jpeg", ".jpg", ".png", ".ppm", ".tif", ".tiff", ".webp"})
"""File endings taken as images wherever a folder is scanned (export inputs, ImageFolder datasets)."""

ImageInput = Image.Image | np.ndarray | torch.Tensor | str | os.PathLike
"""One image: a PIL image, an (H, W) / (H, W, C) uint8 array, a (C, H, W) / (H, W) tensor
(uint8 0-255 or floating 0-1), or a file path; C is 1, 3 or 4 (4 = RGBA)."""

AlphaMode = Literal["composite", "drop"]
Size = tuple[int, int]

_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_16BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


class ImageLoadError(ValueError):
    """An input cannot be read as an image.

    Raised for a missing, unreadable, truncated or undecodable file (the message names it), a
    refused decompression bomb (:class:`ImageTooLargeError`), a zero-sized image, an array or
    tensor of the wrong dtype, shape or value range, and a Pillow mode with no RGB conversion.
    Catch it to skip bad inputs.
    """


class ImageTooLargeError(ImageLoadError):
    """A file has more pixels than ``PIL.Image.MAX_IMAGE_PIXELS`` (Pillow's decompression-bomb limit)."""


# ---- loading ---------------------------------------------------------------------------------


def is_image(obj: object) -> bool:
    """Whether ``obj`` is one image input rather than a collection of them."""
    return isinstance(obj, (Image.Image, np.ndarray, torch.Tensor, str, os.PathLike))


def image_size(source: ImageInput) -> Size:
    """(width, height) of ``source`` as the processor sees it, i.e. after EXIF orientation.

    Files are read up to their header only (no pixel decoding); arrays and tensors are checked
    for shape and dtype, so bad inputs fail here already (float tensors' value range is checked
    when they are loaded).

    Raises:
        ImageLoadError: the input cannot be an image (see :class:`ImageLoadError`).
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        with _open_file(path) as image:
            return _oriented_size(image)
    if isinstance(source, Image.Image):
        size = _oriented_size(source)
    elif isinstance(source, np.ndarray):
        size = _check_array(source)
    elif isinstance(source, torch.Tensor):
        size = _check_tensor(source)
    else:
        raise _unsupported(source)
    _check_nonempty(size)
    return size


def load_image(
    source: ImageInput,
    *,
    alpha_mode: AlphaMode = "composite",
    background_color: tuple[int, int, int] = (255, 255, 255),
) -> Image.Image:
    """Decode ``source`` to an RGB PIL image, EXIF orientation applied.

    Colour conversion:
        - Transparency (an alpha band, or a ``transparency`` key in ``image.info`` as P, L and
          RGB images with a tRNS chunk have): ``alpha_mode="composite"`` alpha-composites the
          image over an opaque ``background_color``; ``"drop"`` discards alpha as Kimi-VL's
          ``image.convert("RGB")`` does, which shows whatever colour transparent pixels store.
        - 16-bit modes (``I;16*``) map 0-65535 onto 0-255 with rounding (Pillow's own
          conversion clips at 255); every other mode (1, L, P, CMYK, YCbCr, I, F, ...) uses
          Pillow's ``convert("RGB")``, without colour management.
        - Multi-frame files give their first frame.
        - Tensors: uint8 is taken as is; floating values must lie in [0, 1] and are quantised as
          ``round(x * 255)``, since resizing is defined on uint8 pixels.

    Raises:
        ImageLoadError: the input cannot be an image (see :class:`ImageLoadError`).
        ImageTooLargeError: a file has more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels (images
            already in memory are not limited).
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        with _open_file(path) as image:
            try:
                return _decode(image, alpha_mode, background_color)
            except (OSError, ValueError) as error:
                raise ImageLoadError(f"cannot decode image file {path!r}: {error}") from error
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, np.ndarray):
        image = _array_to_pil(source)
    elif isinstance(source, torch.Tensor):
        image = _array_to_pil(_tensor_to_array(source))
    else:
        raise _unsupported(source)
    try:
        return _decode(image, alpha_mode, background_color)
    except OSError as error:
        raise ImageLoadError(f"cannot decode PIL image {getattr(image, 'filename', '')!r}: {error}") from error


def _unsupported(source: object) -> ImageLoadError:
    return ImageLoadError(
        f"unsupported image type {type(source).__name__}; expected a PIL image, a uint8 numpy "
        "array, a tensor or a file path"
    )


def _open_file(path: str) -> Image.Image:
    """Open ``path`` lazily (header only), refusing images over Pillow's pixel limit."""
    try:
        image = Image.open(path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise ImageTooLargeError(f"refusing image file {path!r}: {error}") from error
    except OSError as error:  # missing, unreadable, or not an image (UnidentifiedImageError)
        raise ImageLoadError(f"cannot open image file {path!r}: {error}") from error
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and image.width * image.height > limit:
        image.close()
        raise ImageTooLargeError(
            f"refusing image file {path!r}: {image.width}x{image.height} = {image.width * image.height} "
            f"pixels exceeds PIL.Image.MAX_IMAGE_PIXELS = {limit} (decompression-bomb guard)"
        )
    return image


def _orientation(image: Image.Image) -> int:
    # PngImageFile.getexif() decodes the whole file to look for an eXIf chunk after the pixel
    # data; the base method reads only the metadata parsed so far, so a size probed from the
    # header always matches the decoded image.
    orientation = Image.Image.getexif(image).get(ExifTags.Base.Orientation, 1)
    return orientation if isinstance(orientation, int) else 1


def _oriented_size(image: Image.Image) -> Size:
    width, height = image.size
    return (height, width) if _orientation(image) in (5, 6, 7, 8) else (width, height)


def _check_nonempty(size: Size) -> None:
    if size[0] == 0 or size[1] == 0:
        raise ImageLoadError(f"image has zero size ({size[0]}x{size[1]} px)")


def _decode(image: Image.Image, alpha_mode: AlphaMode, background: tuple[int, int, int]) -> Image.Image:
    _check_nonempty(image.size)
    transpose = _TRANSPOSE.get(_orientation(image))  # read before decoding, as image_size() does
    image.load()  # so that a file's image outlives the file
    rgb = _to_rgb(image, alpha_mode, background)
    return rgb if transpose is None else rgb.transpose(transpose)


def _to_rgb(image: Image.Image, alpha_mode: AlphaMode, background: tuple[int, int, int]) -> Image.Image:
    if image.mode in _16BIT_MODES:
        image = _16bit_to_8bit(image)
    try:
        if alpha_mode == "composite" and (image.mode in _ALPHA_MODES or "transparency" in image.info):
            canvas = Image.new("RGBA", image.size, (*background, 255))
            canvas.alpha_composite(image.convert("RGBA"))
            return canvas.convert("RGB")
        return image if image.mode == "RGB" else image.convert("RGB")
    except ValueError as error:  # Pillow: "conversion from <mode> to <mode> not supported"
        raise ImageLoadError(f"cannot convert Pillow mode {image.mode!r} to RGB: {error}") from error


def _16bit_to_8bit(image: Image.Image) -> Image.Image:
    values = np.asarray(image).astype(np.int64)
    return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8))


def _check_array(array: np.ndarray) -> Size:
    if array.dtype != np.uint8:
        raise ImageLoadError(f"numpy images must be uint8 (0-255), got dtype {array.dtype}")
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3, 4))):
        raise ImageLoadError(f"numpy images must be (H, W) or (H, W, C) with C in (1, 3, 4), got shape {array.shape}")
    return array.shape[1], array.shape[0]


def _array_to_pil(array: np.ndarray) -> Image.Image:
    _check_nonempty(_check_array(array))
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(array))  # mode L, RGB or RGBA from the shape


def _check_tensor(tensor: torch.Tensor) -> Size:
    if tensor.dtype != torch.uint8 and not tensor.is_floating_point():
        raise ImageLoadError(f"image tensors must be uint8 (0-255) or floating (0-1), got {tensor.dtype}")
    if not (tensor.ndim == 2 or (tensor.ndim == 3 and tensor.shape[0] in (1, 3, 4))):
        raise ImageLoadError(
            f"image tensors must be (H, W) or (C, H, W) with C in (1, 3, 4), got shape {tuple(tensor.shape)}"
        )
    return tensor.shape[-1], tensor.shape[-2]


def _tensor_to_array(tensor: torch.Tensor) -> np.ndarray:
    """(C, H, W) or (H, W) uint8 / float tensor -> (H, W, C) or (H, W) uint8 array."""
    _check_tensor(tensor)
    pixels = tensor.detach().cpu()
    if pixels.is_floating_point():
        pixels = pixels.float()
        if not bool(((pixels >= 0) & (pixels <= 1)).all()):
            raise ImageLoadError(
                "floating image tensors must hold values in [0, 1], got values in "
                f"[{pixels.min().item()}, {pixels.max().item()}]"
            )
        pixels = pixels.mul(255).round_().to(torch.uint8)
    if pixels.ndim == 3:
        pixels = pixels.permute(1, 2, 0)
    return pixels.contiguous().numpy()
