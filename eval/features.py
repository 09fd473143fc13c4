"""Frozen features of a split: the resize policy, the feature views, pack-wise extraction and the cache.

Encoder views, all from one forward over packs of whole images (MoonViT has no CLS token):
    ``mean``: each image's patch tokens after the final norm, averaged: (N, D).
    ``merged-mean``: each image's 2x2 merged tokens (4 patch tokens concatenated in the merger's
        order, as the projector sees them), averaged: (N, 4D).
    ``last4``: the per-image means of the last 4 blocks' outputs (before the final norm),
        concatenated: (N, 4D); needs at least 4 blocks.
``pixels`` is the no-encoder baseline: an image's raw pixels scaled to [0, 1], flattened.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from moonvit import DEFAULT_MAX_PATCHES_PER_PACK, MoonViT, MoonViTImageProcessor, MoonViTOutput, load_image, pack_images
from moonvit.processor import ImageInput

from .datasets import Split
from .encoder import FrozenEncoder

__all__ = [
    "ENCODER_VIEWS",
    "FEATURE_VIEWS",
    "FeatureCache",
    "ResizePolicy",
    "encoder_views",
    "extract_features",
    "pixel_features",
    "split_features",
]

ENCODER_VIEWS = ("mean", "merged-mean", "last4")
FEATURE_VIEWS = (*ENCODER_VIEWS, "pixels")
CACHE_FORMAT = 1
PIXEL_SIDE = 32
"""Side the ``pixels`` view resizes images to when a split's images differ in size (ImageFolder)."""


@dataclass(frozen=True)
class ResizePolicy:
    """How images are resized before the processor (which never upscales).

    Attributes:
        short_side: the RGB image is resized with Pillow bicubic, aspect ratio kept, so that its
            short side is this many pixels (both sides rounded); 0 keeps the native size. The
            default 112 turns a 28x28 image into 8x8 patches (4x4 merged tokens).
    """

    short_side: int = 112

    def __post_init__(self) -> None:
        if self.short_side < 0:
            raise ValueError(f"short_side must be >= 0 (0 = native size), got {self.short_side}")

    def __call__(self, image: Image.Image) -> Image.Image:
        if self.short_side == 0 or min(image.size) == self.short_side:
            return image
        scale = self.short_side / min(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        return image.resize(size, Image.Resampling.BICUBIC)


def encoder_views(output: MoonViTOutput, grid_hws: torch.Tensor, views: Iterable[str]) -> dict[str, torch.Tensor]:
    """Per-image feature views of one pack's forward.

    Args:
        output: the encoder's output for a pack of N images, with ``hidden_states`` when ``last4`` is asked.
        grid_hws: (N, 2) patch grids of the pack's images.
        views: names from :data:`ENCODER_VIEWS`.

    Returns:
        {view: (N, F) float32}: F = D for ``mean``, 4D for ``merged-mean`` and ``last4``.
    """
    patches = (grid_hws[:, 0] * grid_hws[:, 1]).to(output.last_hidden_state.device)
    result = {}
    for view in views:
        if view == "mean":
            result[view] = _segment_mean(output.last_hidden_state, patches)
        elif view == "merged-mean":
            group = output.merged.shape[1]
            result[view] = _segment_mean(output.merged.flatten(1), patches // group)
        elif view == "last4":
            if output.hidden_states is None or len(output.hidden_states) < 5:
                raise ValueError("the last4 view needs the hidden states of an encoder with at least 4 blocks")
            result[view] = torch.cat([_segment_mean(h, patches) for h in output.hidden_states[-4:]], dim=1)
        else:
            raise ValueError(f"unknown encoder view {view!r}; choose from {ENCODER_VIEWS}")
    return result


def _segment_mean(tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(L, F) tokens of N consecutive segments of ``counts`` (N,) tokens -> (N, F) float32 means."""
    owner = torch.repeat_interleave(torch.arange(len(counts), device=tokens.device), counts)
    sums = torch.zeros(len(counts), tokens.shape[1], device=tokens.device).index_add_(0, owner, tokens.float())
    return sums / counts.unsqueeze(1)


def available_views(model: MoonViT) -> tuple[str, ...]:
    """The encoder views ``model`` can give (``last4`` needs 4 blocks)."""
    return ENCODER_VIEWS if model.config.num_hidden_layers >= 4 else ENCODER_VIEWS[:2]


def extract_features(
    model: MoonViT,
    processor: MoonViTImageProcessor,
    images: Iterable[ImageInput],
    views: Iterable[str],
    *,
    resize: ResizePolicy,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
    total: int | None = None,
    description: str = "features",
) -> dict[str, torch.Tensor]:
    """Run the frozen encoder over ``images`` in packs of at most ``max_patches_per_pack`` patches.

    Images are loaded to RGB, resized by ``resize``, then packed with :func:`moonvit.pack_images`
    and processed pack by pack without autograd, with a tqdm bar over images.

    Returns:
        {view: (N, F) float32 on the CPU}, rows in input order.
    """
    views = tuple(views)
    device = model.device
    chunks: dict[str, list[torch.Tensor]] = {view: [] for view in views}
    resized = (resize(processor.load_image(image)) for image in images)
    with tqdm(total=total, desc=description, unit="img") as bar, torch.inference_mode():
        for pack in pack_images(resized, processor, max_patches_per_pack):
            batch = processor([item.source for item in pack.items],
                              in_token_limit=[item.in_token_limit for item in pack.items])
            output = model(batch.pixel_values.to(device), batch.grid_hws, output_hidden_states="last4" in views)
            for view, value in encoder_views(output, batch.grid_hws, views).items():
                chunks[view].append(value.cpu())
            bar.update(len(pack.items))
    if not any(chunks.values()):
        raise ValueError("no images to extract features from")
    return {view: torch.cat(values) for view, values in chunks.items()}


def pixel_features(images: np.ndarray | Iterable[ImageInput]) -> torch.Tensor:
    """Raw pixels in [0, 1], flattened: (N, H * W) for an (N, H, W) uint8 array; for files,
    RGB images resized (Pillow bicubic) to :data:`PIXEL_SIDE` squares: (N, 3 * PIXEL_SIDE ** 2)."""
    if isinstance(images, np.ndarray):
        return torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255)
    side = (PIXEL_SIDE, PIXEL_SIDE)
    rows = [np.asarray(load_image(path).resize(side, Image.Resampling.BICUBIC)) for path in images]
    return torch.from_numpy(np.stack(rows).reshape(len(rows), -1).astype(np.float32) / 255)


class FeatureCache:
    """Feature matrices on disk, one safetensors file per key, the key stored in its metadata.

    A key is a JSON-able dict (checkpoint hash, dataset and split fingerprint, preprocessing, view);
    its sha256 names the file, so any change to it misses.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, key: dict[str, Any]) -> Path:
        text = json.dumps({"format": CACHE_FORMAT, **key}, sort_keys=True)
        return self.root / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.safetensors"

    def load(self, key: dict[str, Any]) -> torch.Tensor | None:
        path = self.path(key)
        return load_file(path)["features"] if path.is_file() else None

    def save(self, key: dict[str, Any], features: torch.Tensor) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        partial = path.with_suffix(".partial")
        save_file({"features": features.contiguous()}, partial, metadata={"key": json.dumps(key, sort_keys=True)})
        partial.replace(path)


def split_features(
    encoder: FrozenEncoder,
    split: Split,
    view: str,
    *,
    dataset: str,
    split_name: str,
    resize: ResizePolicy,
    cache: FeatureCache,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
) -> tuple[torch.Tensor, bool]:
    """One view's (N, F) features of ``split``, from the cache or by running the encoder once.

    On a miss every view the encoder can give is extracted from the same forward and cached, so
    probing another view later does not re-run the encoder. ``pixels`` is computed, never cached.

    Returns:
        (features, cache_hit).
    """
    if view == "pixels":
        return pixel_features(split.images), False
    views = available_views(encoder.model)
    if view not in views:
        raise ValueError(f"view {view!r} is not available for this encoder (it gives {views})")
    base = {
        "checkpoint": encoder.hash,
        "dtype": str(encoder.model.dtype),
        "dataset": dataset,
        "split": split_name,
        "split_fingerprint": split.fingerprint(),
        "processor": encoder.processor.to_dict(),
        "resize": asdict(resize),
        "max_patches_per_pack": max_patches_per_pack,
    }
    cached = cache.load({**base, "view": view})
    if cached is not None:
        return cached, True
    extracted = extract_features(encoder.model, encoder.processor, split.images, views, resize=resize,
                                 max_patches_per_pack=max_patches_per_pack, total=len(split),
                                 description=f"{dataset} {split_name}")
    for name, features in extracted.items():
        cache.save({**base, "view": name}, features)
    return extracted[view], False
