"""Visual tokens inside a Ray Data pipeline: :class:`EncodeImages`, a callable class for
``ray.data.Dataset.map_batches``.

This module does not import Ray (nor does anything else in the library): Ray only calls the
class, so it works with whatever Ray the pipeline runs (install it with ``moonvit[ray]``).

Example::

    import ray
    from moonvit.ray_data import EncodeImages

    ds = ray.data.from_items([{"image": str(p)} for p in paths])  # or read_binary_files(...)
    tokens = ds.map_batches(EncodeImages, fn_constructor_args=("moonshotai/Kimi-VL-A3B-Instruct",),
                            compute=ray.data.ActorPoolStrategy(size=2), num_gpus=1, batch_size=64)
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .cli import torch_dtype
from .encode import encode_pack
from .media.image import ImageLoadError, decompression_bombs_raised
from .media.packing import DEFAULT_MAX_PATCHES_PER_PACK, pack_images
from .media.processor import MoonViTImageProcessor
from .model.encoder import MoonViT
from .model.projector import MoonViTProjector

__all__ = ["EncodeImages", "object_column"]


class EncodeImages:
    """Encode a batch of images to visual tokens: a callable class for ``Dataset.map_batches``.

    Ray builds one instance per actor, so the encoder (and the projector) is loaded once per
    actor; each call decodes its batch's images with the checkpoint's own processor, packs them
    under ``max_patches_per_pack`` and encodes pack by pack (:func:`~moonvit.encode.encode_pack`),
    giving each image the tokens that :func:`~moonvit.encode.encode_images` gives it (to the float
    error of other pack shapes).

    Input batch (``batch_format="numpy"``, Ray's default): a column ``image_column`` (default
    ``"image"``) of file paths (str) or encoded file bytes (``read_binary_files`` gives a
    ``"bytes"`` column: pass ``image_column="bytes"``). Every input column is passed through.

    Output columns added, one row per input row:
        - ``tokens``: float32 (n, F) per row, in an object array of arrays (Ray stores it as a
          variable-shaped tensor column): with ``projector=False`` the merged tokens, each 2x2
          group flattened to F = 4 * D in the merger's order (``encoded.reshape(n, 4, D)`` gives
          ``encode_images``' layout back); with ``projector=True`` the projected tokens, F the
          language model's width. A failed row has a (0, F) array.
        - ``grid_thw``: int64 (3,) per row, (frames, rows, cols) of patches; zeros for a failed row.
        - ``token_count``: int64, n; 0 for a failed row.
        - ``error``: str, empty when the image was encoded, else why it was not (it could not be
          read or decoded, or not fitted to the processor's limits). Such a row does not fail
          the batch: filter with ``ds.filter(lambda row: not row["error"])``.

    Args:
        checkpoint: a folder or hub id (see :meth:`MoonViT.from_pretrained`).
        dtype: the models' dtype (``bf16``, ``fp16``, ``fp32``, ``fp64`` or their long names);
            the tokens are returned as float32 whatever it is.
        device: where to encode (default: the first CUDA device when there is one, else CPU).
        projector: return projected tokens (the checkpoint must hold a projector).
        max_patches_per_pack: the patch budget of one encoder forward (see
            :func:`~moonvit.media.packing.pack_images`); an image larger than it alone is scaled
            down to fit.
        image_column: the column of paths or bytes.
        processor_overrides: processor settings to change (e.g. ``{"in_token_limit": 1024}``).

    Example (4 actors of one GPU each; Ray refuses ``num_gpus`` without ``batch_size``, the images
    one call decodes before packing them)::

        import ray
        from moonvit.ray_data import EncodeImages

        ds = ray.data.read_binary_files("s3://bucket/images/", include_paths=True)
        ds = ds.map_batches(EncodeImages, fn_constructor_args=("moonshotai/Kimi-VL-A3B-Instruct",),
                            fn_constructor_kwargs={"image_column": "bytes"},
                            compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1, batch_size=64)
        ds.drop_columns(["bytes"]).write_parquet("/data/tokens")
    """

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        dtype: str = "bf16",
        device: torch.device | str | None = None,
        projector: bool = False,
        max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
        image_column: str = "image",
        processor_overrides: dict[str, Any] | None = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch_dtype(dtype)
        self.encoder = MoonViT.from_pretrained(checkpoint, device="cpu").to(self.device, self.dtype).eval()
        self.projector = (
            MoonViTProjector.from_pretrained(checkpoint, device="cpu").to(self.device, self.dtype).eval()
            if projector
            else None
        )
        self.processor = MoonViTImageProcessor.from_pretrained(checkpoint, **(processor_overrides or {}))
        self.max_patches_per_pack = max_patches_per_pack
        self.image_column = image_column
        if self.projector is not None:
            self.width = self.projector.config.text_hidden_size
        else:
            kh, kw = self.encoder.config.merge_kernel_size
            self.width = kh * kw * self.encoder.config.hidden_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Encode one batch (see the class): the input columns, plus tokens, grid_thw, token_count, error."""
        sources = batch[self.image_column]
        count = len(sources)
        tokens = [np.zeros((0, self.width), np.float32)] * count
        grids = np.zeros((count, 3), np.int64)
        errors = [""] * count
        decoded: list[Image.Image] = []
        rows: list[int] = []
        for row, source in enumerate(sources):
            try:
                decoded.append(self._decode(source))
                rows.append(row)
            except (ValueError, OSError) as error:  # ImageLoadError included
                errors[row] = str(error)
        # each image alone first: one whose size the processor refuses fails its row only
        fitted = []
        for row, image in zip(rows, decoded):
            try:
                self.processor.plan_image(*image.size)
                fitted.append((row, image))
            except ValueError as error:
                errors[row] = str(error)
        packs = pack_images([image for _, image in fitted], self.processor, self.max_patches_per_pack)
        for pack in packs:
            encoded = encode_pack(self.encoder, self.processor, pack, skip_errors=True)
            for key, reason in encoded.failures.items():
                errors[fitted[key[0]][0]] = reason
            if not encoded.items:
                continue
            assert encoded.grid is not None
            with torch.no_grad():
                out = self.projector(encoded.merged) if self.projector is not None else encoded.merged.flatten(1)
            parts = encoded.split_tokens(out.float().cpu())
            for item, thw, part in zip(encoded.items, encoded.grid.grid_thws.tolist(), parts):
                row = fitted[item.index][0]
                tokens[row] = part.numpy()
                grids[row] = thw
        result = dict(batch)
        result["tokens"] = object_column(tokens)
        result["grid_thw"] = grids
        result["token_count"] = np.array([len(t) for t in tokens], np.int64)
        result["error"] = np.array(errors, dtype=object)
        return result

    def _decode(self, source: object) -> Image.Image:
        """A row's image, decoded to RGB with the processor's transparency settings."""
        if isinstance(source, (bytes, bytearray, memoryview, np.bytes_)):
            try:
                with decompression_bombs_raised():
                    image = Image.open(io.BytesIO(bytes(source)))
                    image.load()
            except (OSError, ValueError, Image.DecompressionBombError) as error:
                raise ImageLoadError(f"cannot decode image bytes: {error}") from error
            return self.processor.load_image(image)
        if isinstance(source, (str, np.str_, Path)):
            return self.processor.load_image(str(source))
        raise ImageLoadError(f"unsupported image type {type(source).__name__}; expected a file path or bytes")


def object_column(values: Sequence[object]) -> np.ndarray:
    """A batch column of one Python object per row, as a 1-D object array: ``np.array`` would stack
    same-shaped arrays into one and turn bytes into fixed-width ``S`` strings, which drop trailing
    NUL bytes."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out
