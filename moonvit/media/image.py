"""Decoding images: any supported input to an RGB PIL image, with errors that name the input.

Inputs (:data:`ImageInput`) are PIL images, numpy arrays, tensors and file paths.
:func:`image_size` reads an input's size without decoding pixels (file headers
only), so that packs can be planned before any image is decoded;
:func:`load_image` decodes to RGB with the EXIF orientation applied.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import ExifTags, Image

__all__ = [
    "IMAGE_EXTENSIONS",
    "AlphaMode",
    "ImageChangedError",
    "ImageInput",
    "ImageLoadError",
    "ImageTooLargeError",
    "ImageWarning",
    "PinnedFile",
    "decompression_bombs_raised",
    "image_size",
    "image_sources",
    "images_below",
    "is_image",
    "load_image",
]

IMAGE_EXTENSIONS = frozenset(
    {".bmp", ".gif", ".jpeg", ".jpg", ".pbm", ".pgm", ".png", ".pnm", ".ppm", ".tif", ".tiff", ".webp"}
)
"""File endings taken as images wherever a folder is scanned (export inputs, ImageFolder datasets)."""


def images_below(folder: str | os.PathLike) -> list[Path]:
    """Every image file (:data:`IMAGE_EXTENSIONS`) below ``folder``, at any depth, in
    :func:`~moonvit.files.files_below`'s order: an unlabelled ``images:DIR`` set.

    Raises:
        ValueError: ``folder`` is not a readable folder, or holds no image (the folder named).
    """
    from ..files import files_below, folder_problem  # moonvit.files sits below the media package

    problem = folder_problem(folder)
    if problem is not None:
        raise ValueError(f"image folder {folder} {problem}")
    files, _ = files_below(folder, IMAGE_EXTENSIONS)
    if not files:
        raise ValueError(f"{folder} holds no images ({' '.join(sorted(IMAGE_EXTENSIONS))}), at any depth")
    return files


ImageInput = Image.Image | np.ndarray | torch.Tensor | str | os.PathLike
"""One image: a PIL image, an (H, W) / (H, W, C) array, a (C, H, W) / (H, W) tensor (arrays and
tensors uint8 0-255 or floating 0-1), or a file path; C is 1, 3 or 4 (4 = RGBA)."""

AlphaMode = Literal["composite", "drop", "composite_rgba"]
"""What :func:`load_image` does with transparency: "composite" paints every kind over the background,
"drop" discards it, "composite_rgba" paints mode RGBA only and discards the rest (LocateAnything)."""
Size = tuple[int, int]

_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_16BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})
_WIDE_MODES = _16BIT_MODES | {"I", "F"}  # single-band modes whose values are not 0-255
# TIFF tags: BitsPerSample, SampleFormat (1 unsigned, 2 signed, 3 float), S{Min,Max}SampleValue
_TIFF_BITS, _TIFF_FORMAT, _TIFF_MIN, _TIFF_MAX = 258, 339, 340, 341
_SAMPLE_FORMATS = {1: "unsigned", 2: "signed", 3: "float"}
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
    tensor of the wrong dtype, shape or value range, and a Pillow mode with no RGB conversion or
    no known value range (the message names the mode). Catch it to skip bad inputs.
    """


class ImageChangedError(ImageLoadError):
    """A :class:`PinnedFile` no longer holds the bytes it was pinned to: the file was replaced
    or changed after its content hash was taken."""


@dataclass(frozen=True)
class PinnedFile(os.PathLike[str]):
    """An image file pinned to the content it had when hashed: a path (``os.fspath`` gives it, so
    it goes wherever a path goes) with the SHA-256 of its bytes.

    :func:`load_image` reads the file once, checks those bytes' hash and decodes those very bytes,
    so what a program records or stores under the hash is the hashed content's, never a file
    that replaced it in between (that is an :class:`ImageChangedError`). :func:`image_size` reads
    the header as for any path; a processor's pixels are checked against the planned size anyway.
    """

    path: str
    sha256: str

    def __fspath__(self) -> str:
        return self.path

    def read_bytes(self) -> bytes:
        """The file's bytes, read once and checked against :attr:`sha256`.

        Raises:
            ImageLoadError: the file cannot be read; :class:`ImageChangedError`: its bytes changed.
        """
        try:
            data = Path(self.path).read_bytes()
        except OSError as error:
            raise ImageLoadError(f"cannot open image file {self.path!r}: {error}") from error
        found = hashlib.sha256(data).hexdigest()
        if found != self.sha256:
            raise ImageChangedError(
                f"image file {self.path!r} changed after it was planned (SHA-256 {found[:12]}..., "
                f"planned {self.sha256[:12]}...); run again to take its new content"
            )
        return data


class ImageWarning(UserWarning):
    """An image was read, but not all of it shows: an animated file's later frames, or a wide-range
    image whose values fill so little of its declared range that its 8-bit picture is flat."""


class ImageTooLargeError(ImageLoadError):
    """A file has more pixels than ``PIL.Image.MAX_IMAGE_PIXELS`` (Pillow's decompression-bomb limit).

    Raise the limit (``PIL.Image.MAX_IMAGE_PIXELS = n``, or None for none) to accept such files.
    """


# ---- loading ---------------------------------------------------------------------------------


def image_sources(images: ImageInput | Iterable[ImageInput]) -> Iterable[ImageInput]:
    """The images of ``images``: one image, or any iterable of them (list, generator, dataset with
    ``__getitem__``, 4-D batch), not consumed. Anything else is taken as one input, for the loader
    to name its type."""
    if is_image(images) or isinstance(images, (bytes, bytearray)):
        return [images]  # type: ignore[list-item]
    try:
        iter(images)  # type: ignore[arg-type]
    except TypeError:
        return [images]  # type: ignore[list-item]
    return images  # type: ignore[return-value]


def is_image(obj: object) -> bool:
    """Whether ``obj`` is one image input rather than a collection of them.

    A 4-D array or tensor is a batch, (N, H, W, C) or (N, C, H, W): a collection of N images.
    """
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return obj.ndim <= 3
    return isinstance(obj, (Image.Image, str, os.PathLike))


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
          ``image.convert("RGB")`` does, which shows whatever colour transparent pixels store;
          ``"composite_rgba"`` composites images of mode ``RGBA`` exactly (RGBa, LA, La, PA and a
          ``transparency`` key are not) and drops alpha from every other mode, NVIDIA
          LocateAnything's rule.
        - Every mode is mapped from its real value range onto 0-255 (Pillow's own conversion
          clips I, I;16 and F at 255, which turns them white or black):
            - ``I;16*`` (unsigned 16-bit): 0-65535, rounded;
            - ``I`` (32-bit integer): the range its file declares: a TIFF's
              ``SMinSampleValue`` / ``SMaxSampleValue``, else its sample type (BitsPerSample,
              SampleFormat: signed 16-bit -32768-32767, ...); 16-bit PGM / PPM: 0-65535;
            - ``F`` (32-bit float): a TIFF's ``SMinSampleValue`` / ``SMaxSampleValue``, else
              [0, 1] (values outside it, NaN or infinity are refused);
            - an ``I`` image without a declared range (made in memory, other formats) is refused;
            - ``La`` (premultiplied alpha) is converted to ``LA`` first;
            - every other mode (1, L, P, RGB, RGBX, CMYK, YCbCr, LAB, HSV, ...) through Pillow's
              ``convert("RGB")``, without colour management.
        - Multi-frame files (animated GIF, WebP, APNG; multi-page TIFF) give their first frame,
          with an :class:`ImageWarning` naming the file and its frame count.
        - A wide-range image whose values fill so little of its declared range that fewer than
          :data:`FLAT_LEVELS` grey levels remain is converted as the rule says, with an
          :class:`ImageWarning` naming the file, its values and the range.
        - Arrays and tensors: uint8 is taken as is; floating values must lie in [0, 1] and are
          quantised as ``round(x * 255)`` (in float32), since resizing is defined on uint8 pixels.

    Raises:
        ImageLoadError: the input cannot be an image (see :class:`ImageLoadError`).
        ImageTooLargeError: a file has more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels (images
            already in memory are not limited).
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        data = source.read_bytes() if isinstance(source, PinnedFile) else None
        with _open_file(path, data) as image:
            try:
                return _decode(image, alpha_mode, background_color, repr(path))
            except (OSError, ValueError) as error:
                raise ImageLoadError(f"cannot decode image file {path!r}: {error}") from error
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, np.ndarray):
        image = _array_to_pil(source, "numpy images")
    elif isinstance(source, torch.Tensor):
        image = _array_to_pil(_tensor_to_array(source), "image tensors")
    else:
        raise _unsupported(source)
    name = getattr(image, "filename", "") or "in memory"
    try:
        return _decode(image, alpha_mode, background_color, f"PIL image ({name})")
    except (OSError, ValueError) as error:
        raise ImageLoadError(f"cannot decode PIL image ({name}): {error}") from error


def _unsupported(source: object) -> ImageLoadError:
    return ImageLoadError(
        f"unsupported image type {type(source).__name__}; expected a PIL image, a numpy array, a tensor or a file path"
    )


def _open_file(path: str, data: bytes | None = None) -> Image.Image:
    """Open ``path`` lazily (header only), or the file's ``data`` already read, refusing images
    over Pillow's pixel limit.

    Pillow warns (``DecompressionBombWarning``) between one and two times its limit and raises
    above; both become the one :class:`ImageTooLargeError`, so no warning is printed on top (in a
    thread of a program's own, outside a command line, Pillow's warning may print first: see
    :func:`decompression_bombs_raised`).
    """
    try:
        with decompression_bombs_raised():
            image = Image.open(path if data is None else io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise _too_large(path, str(error)) from None
    except OSError as error:  # missing, unreadable, or not an image (UnidentifiedImageError)
        raise ImageLoadError(f"cannot open image file {path!r}: {error}") from error
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and image.width * image.height > limit:
        image.close()
        raise _too_large(path, f"{image.width}x{image.height} = {image.width * image.height} pixels")
    return image


@contextmanager
def decompression_bombs_raised() -> Iterator[None]:
    """Within the block, Pillow's ``DecompressionBombWarning`` is raised instead of printed (the
    caller refuses the image with one error).

    ``warnings.catch_warnings`` swaps the process's one filter list on entry and restores it on
    exit, so the blocks of two threads that interleave restore each other's lists (a filter left on
    for good, or another's lost). Only the main thread enters it here; in another thread (the
    ``--workers`` decode threads) the block changes nothing, and the warning meets the filters in
    force: the command lines enter this block on their main thread for their whole run
    (:func:`moonvit.cli.one_line_warnings`), and the size check after the open refuses the image
    in any case.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


def _too_large(path: str, size: str) -> ImageTooLargeError:
    return ImageTooLargeError(
        f"refusing image file {path!r}: {size}, over PIL.Image.MAX_IMAGE_PIXELS = {Image.MAX_IMAGE_PIXELS} "
        "(Pillow's decompression-bomb guard); to accept it, raise the limit first: "
        "PIL.Image.MAX_IMAGE_PIXELS = <pixels> (None for no limit)"
    )


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


def _decode(image: Image.Image, alpha_mode: AlphaMode, background: tuple[int, int, int], name: str) -> Image.Image:
    _check_nonempty(image.size)
    frames = getattr(image, "n_frames", 1)
    if frames > 1:
        warnings.warn(
            f"{name} is animated ({frames} frames, {image.format}): its first frame is taken as the image; "
            "to encode it as a clip, decode the frames and pass VideoFrames(frames, fps)",
            ImageWarning,
            stacklevel=3,
        )
    transpose = _TRANSPOSE.get(_orientation(image))  # read before decoding, as image_size() does
    image.load()  # so that a file's image outlives the file
    rgb = _to_rgb(image, alpha_mode, background, name)
    return rgb if transpose is None else rgb.transpose(transpose)


def _to_rgb(image: Image.Image, alpha_mode: AlphaMode, background: tuple[int, int, int], name: str) -> Image.Image:
    if image.mode in _WIDE_MODES:
        image = _to_8bit(image, name)
    elif image.mode == "La":  # Pillow converts La to LA only
        image = image.convert("LA")
    try:
        if _composites(image, alpha_mode):
            canvas = Image.new("RGBA", image.size, (*background, 255))
            canvas.alpha_composite(image.convert("RGBA"))
            return canvas.convert("RGB")
        return image if image.mode == "RGB" else image.convert("RGB")
    except ValueError as error:  # Pillow: "conversion from <mode> to <mode> not supported"
        raise ImageLoadError(f"cannot convert Pillow mode {image.mode!r} to RGB: {error}") from error


def _composites(image: Image.Image, alpha_mode: AlphaMode) -> bool:
    """Whether ``image`` is painted over the background rather than converted with its alpha dropped."""
    if alpha_mode == "composite_rgba":
        return image.mode == "RGBA"
    return alpha_mode == "composite" and (image.mode in _ALPHA_MODES or "transparency" in image.info)


# A wide-range image whose values span fewer 8-bit levels than this, though they vary, comes out
# flat enough that the range rule, not the picture, is what the encoder sees: a warning says so.
FLAT_LEVELS = 4


def _to_8bit(image: Image.Image, name: str) -> Image.Image:
    """A single-band ``I;16*``, ``I`` or ``F`` image as mode L, its value range mapped onto 0-255."""
    values = np.asarray(image)
    tags = getattr(image, "tag_v2", None) if image.format == "TIFF" else None
    if image.mode == "I" and tags is not None and _tiff_sample_type(tags) == ("unsigned", 32):
        values = values.view(np.uint32)  # Pillow keeps unsigned 32-bit samples' bits in its int32 mode
    values = values.astype(np.float64)
    low, high = _value_range(image, values, tags)
    scaled = np.floor((np.clip(values, low, high) - low) * (255 / (high - low)) + 0.5)
    vmin, vmax = float(values.min()), float(values.max())
    if vmax > vmin and scaled.max() - scaled.min() < FLAT_LEVELS:
        share = (vmax - vmin) / (high - low)
        warnings.warn(
            f"{name}: Pillow mode {image.mode!r} values {_number(vmin)}..{_number(vmax)} fill {share:.3%} of the "
            f"range {_number(low)}..{_number(high)} its file declares, so its 8-bit picture keeps "
            f"{int(scaled.max() - scaled.min()) + 1} "
            "of 256 grey levels (nearly flat); if the data means another range, convert it first "
            "(e.g. to 'I;16' for 0-65535, or scale to 'L')",
            ImageWarning,
            stacklevel=5,
        )
    return Image.fromarray(scaled.astype(np.uint8))


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else f"{value:g}"


def _tiff_sample_type(tags: Any) -> tuple[str, int]:
    """("unsigned" / "signed" / "float", bits) of a TIFF's samples."""
    kind = _SAMPLE_FORMATS.get(int(np.max(tags.get(_TIFF_FORMAT, 1))), "unsigned")
    return kind, int(np.max(tags.get(_TIFF_BITS, 8)))


def _value_range(image: Image.Image, values: np.ndarray, tags: Any) -> tuple[float, float]:
    """The (low, high) that black and white stand for in a single-band ``I;16*``, ``I`` or ``F``
    image (``tags``: its TIFF tags, or None).

    Raises:
        ImageLoadError: the image declares no range and its values do not show one (see
            :func:`load_image`).
    """
    if image.mode in _16BIT_MODES:
        return 0.0, 65535.0
    if tags is not None and _TIFF_MIN in tags and _TIFF_MAX in tags:
        low, high = (float(np.max(tags[tag])) for tag in (_TIFF_MIN, _TIFF_MAX))
        if high > low:
            return low, high
    if image.mode == "I":
        if image.format == "PPM":  # Pillow scales 16-bit PGM / PPM samples to 0-65535
            return 0.0, 65535.0
        if tags is not None:
            kind, bits = _tiff_sample_type(tags)
            if kind == "signed":
                return -(2.0 ** (bits - 1)), 2.0 ** (bits - 1) - 1
            return 0.0, 2.0**bits - 1
        raise ImageLoadError(
            "Pillow mode 'I' (32-bit integer pixels) with no declared value range: convert it to 'L' or "
            "'I;16' with the range you mean, or pass a uint8 array"
        )
    if not np.isfinite(values).all() or values.min() < 0 or values.max() > 1:
        raise ImageLoadError(
            f"Pillow mode 'F' (float pixels) with values in [{values.min()}, {values.max()}]: float images "
            "are read as 0-1; scale it to [0, 1] or convert it to 'L' with the range you mean"
        )
    return 0.0, 1.0


def _check_array(array: np.ndarray) -> Size:
    if array.dtype != np.uint8 and not np.issubdtype(array.dtype, np.floating):
        raise ImageLoadError(f"numpy images must be uint8 (0-255) or floating (0-1), got dtype {array.dtype}")
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3, 4))):
        raise ImageLoadError(
            f"numpy images must be (H, W) or (H, W, C) with C in (1, 3, 4) (or a list / (N, H, W, C) batch of "
            f"them), got shape {array.shape}"
        )
    return array.shape[1], array.shape[0]


def _array_to_pil(array: np.ndarray, what: str) -> Image.Image:
    """(H, W) or (H, W, C) uint8 or floating 0-1 array -> mode L, RGB or RGBA image."""
    _check_nonempty(_check_array(array))
    if array.dtype != np.uint8:
        values = array.astype(np.float32)
        if not bool(np.isfinite(values).all()) or values.min() < 0 or values.max() > 1:
            raise ImageLoadError(
                f"floating {what} must hold values in [0, 1], got values in [{values.min()}, {values.max()}]"
            )
        array = np.rint(values * np.float32(255)).astype(np.uint8)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(array))  # mode L, RGB or RGBA from the shape


def _check_tensor(tensor: torch.Tensor) -> Size:
    if tensor.dtype != torch.uint8 and not tensor.is_floating_point():
        raise ImageLoadError(f"image tensors must be uint8 (0-255) or floating (0-1), got {tensor.dtype}")
    if not (tensor.ndim == 2 or (tensor.ndim == 3 and tensor.shape[0] in (1, 3, 4))):
        raise ImageLoadError(
            f"image tensors must be (H, W) or (C, H, W) with C in (1, 3, 4) (or a list / (N, C, H, W) batch of "
            f"them), got shape {tuple(tensor.shape)}"
        )
    return tensor.shape[-1], tensor.shape[-2]


def _tensor_to_array(tensor: torch.Tensor) -> np.ndarray:
    """(C, H, W) or (H, W) uint8 / floating tensor -> (H, W, C) or (H, W) uint8 / float32 array."""
    _check_tensor(tensor)
    pixels = tensor.detach().cpu()
    if pixels.is_floating_point():
        pixels = pixels.float()
    if pixels.ndim == 3:
        pixels = pixels.permute(1, 2, 0)
    return pixels.contiguous().numpy()
