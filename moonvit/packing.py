"""Token-budget packing of long image lists, and the :func:`encode_images` one-liner.

:func:`pack_images` groups images, in input order and each one whole, into packs of at most
``max_patches_per_pack`` patches, planning every image from its size alone (file headers, not
pixels). :func:`iter_encode_images` then decodes and encodes one pack at a time and moves each
image's merged tokens off to ``output_device``, so the encoder's working set is bounded by the
budget, not by the length of the list.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .processor import ImageInput, ImagePlan, MoonViTImageProcessor, image_size, is_image

__all__ = [
    "DEFAULT_MAX_PATCHES_PER_PACK",
    "EncodedImage",
    "Pack",
    "PackItem",
    "encode_images",
    "group_into_packs",
    "iter_encode_images",
    "pack_images",
    "plan_pack_item",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PATCHES_PER_PACK = 32768
"""Twice the largest shipped ``in_token_limit`` (16384). With sides of at most 512 patches,
padding and rounding keep every image's grid below 23000 patches at limits up to 16384, so the
default never rescales an image there."""


@dataclass(frozen=True)
class PackItem:
    """One image of a pack.

    Attributes:
        index: position in the input.
        source: the input itself, decoded only when its pack is processed.
        plan: its geometry through the processor.
        in_token_limit: the reduced size budget it was planned with because, alone, it exceeded
            the pack budget; None when the processor's own rule applies.
    """

    index: int
    source: ImageInput
    plan: ImagePlan
    in_token_limit: int | None

    @property
    def rescaled(self) -> bool:
        return self.in_token_limit is not None


@dataclass(frozen=True)
class Pack:
    """Consecutive input images whose patches fit one encoder forward."""

    items: tuple[PackItem, ...]

    @property
    def indices(self) -> list[int]:
        """Input positions of the pack's images, in pack order."""
        return [item.index for item in self.items]

    @property
    def num_patches(self) -> int:
        return sum(item.plan.num_patches for item in self.items)


@dataclass(frozen=True)
class EncodedImage:
    """The encoder's output for one input image.

    Attributes:
        index: position in the input.
        tokens: (rows * cols / 4, 4, D) merged tokens, in the encoder's dtype, on the chosen
            output device.
        grid_hw: (rows, cols) patch grid the image was encoded at.
        rescaled: whether it was scaled below the processor's size to fit the pack budget.
    """

    index: int
    tokens: torch.Tensor
    grid_hw: tuple[int, int]
    rescaled: bool


def pack_images(
    images: ImageInput | Iterable[ImageInput],
    processor: MoonViTImageProcessor,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
) -> Iterator[Pack]:
    """Greedily group ``images`` into packs of at most ``max_patches_per_pack`` patches.

    Packs come in input order and each image lies whole in one pack. ``images`` is consumed
    lazily, one image ahead of the pack being yielded; only sizes are read (file headers, array
    shapes). An image whose padded grid alone exceeds the budget gets the largest
    ``in_token_limit`` whose padded grid fits, recorded in its :class:`PackItem`.

    Raises:
        ImageLoadError: an input cannot be read as an image; the message gives its position.
        ValueError: the budget is below one merged token, or an image cannot be made to fit it
            (or exceeds the position table, see :meth:`MoonViTImageProcessor.plan_image`).
    """
    group = processor.merge_kernel_size[0] * processor.merge_kernel_size[1]
    if max_patches_per_pack < group:
        raise ValueError(f"max_patches_per_pack must hold at least one merged token ({group} patches)")
    sources = [images] if is_image(images) else images
    items = (plan_pack_item(index, source, processor, max_patches_per_pack) for index, source in enumerate(sources))
    yield from group_into_packs(items, max_patches_per_pack)


def group_into_packs(items: Iterable[PackItem], max_patches_per_pack: int) -> Iterator[Pack]:
    """Consecutive runs of ``items`` of at most ``max_patches_per_pack`` patches each, consumed lazily."""
    group: list[PackItem] = []
    total = 0
    for item in items:
        if group and total + item.plan.num_patches > max_patches_per_pack:
            yield Pack(tuple(group))
            group, total = [], 0
        group.append(item)
        total += item.plan.num_patches
    if group:
        yield Pack(tuple(group))


def plan_pack_item(index: int, source: ImageInput, processor: MoonViTImageProcessor, budget: int) -> PackItem:
    """Plan one image from its size alone, scaled down if alone it exceeds ``budget`` patches.

    Raises:
        ImageLoadError, ValueError: as :meth:`MoonViTImageProcessor.plan_image`, the message
            prefixed with the input position (the original error is the cause).
    """
    try:
        size = image_size(source)
        plan = processor.plan_image(*size)
    except ValueError as error:  # ImageLoadError included: keep the type, add the position
        raise type(error)(f"input image {index}: {error}") from error
    if plan.num_patches <= budget:
        return PackItem(index, source, plan, None)
    limit = _fit_token_limit(processor, size, budget)
    plan = processor.plan_image(*size, in_token_limit=limit)
    logger.info(
        "image %d (%dx%d px) scaled to %dx%d px (%d patches) to fit max_patches_per_pack=%d",
        index, *size, *plan.resized_size, plan.num_patches, budget,
    )
    return PackItem(index, source, plan, limit)


def _fit_token_limit(processor: MoonViTImageProcessor, size: tuple[int, int], budget: int) -> int:
    """Largest ``in_token_limit`` whose padded grid has at most ``budget`` patches.

    Assumes the processor's own limit does not fit. The padded patch count never decreases as
    the limit grows, so a bisection finds it.
    """

    def fits(limit: int) -> bool:
        return processor.plan_image(*size, in_token_limit=limit).num_patches <= budget

    if not fits(1):
        smallest = processor.plan_image(*size, in_token_limit=1).num_patches
        raise ValueError(
            f"a {size[0]}x{size[1]} image needs at least {smallest} patches after padding, over "
            f"max_patches_per_pack={budget}"
        )
    low, high = 1, processor.in_token_limit  # fits(low) and not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def iter_encode_images(
    encoder: nn.Module,
    processor: MoonViTImageProcessor,
    images: ImageInput | Iterable[ImageInput],
    *,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
    output_device: torch.device | str = "cpu",
) -> Iterator[EncodedImage]:
    """Encode ``images`` pack by pack, yielding each image's result, in input order.

    Only the images of the pack being encoded are decoded; each pack's merged tokens are moved
    to ``output_device`` before the next pack starts. Runs without autograd, with the encoder in
    whatever mode it is (call ``.eval()`` first).

    Args:
        encoder: a MoonViT: ``encoder(pixel_values, grid_hws).merged`` is (L / 4, 4, D).
        processor: turns images into ``pixel_values`` and ``grid_hws``.
        images: one image or an iterable of them (see :data:`ImageInput`), consumed lazily.
        max_patches_per_pack: patch budget per encoder forward (see :func:`pack_images`).
        output_device: where the results are put.
    """
    device = next(encoder.parameters()).device
    for pack in pack_images(images, processor, max_patches_per_pack):
        batch = processor(
            [item.source for item in pack.items],
            in_token_limit=[item.in_token_limit for item in pack.items],
        )
        with torch.no_grad():
            merged = encoder(batch.pixel_values.to(device), batch.grid_hws).merged.to(output_device)
        grids = batch.grid_hws.tolist()
        group = merged.shape[1]
        for item, grid, tokens in zip(pack.items, grids, merged.split([h * w // group for h, w in grids])):
            yield EncodedImage(item.index, tokens, (grid[0], grid[1]), item.rescaled)


def encode_images(
    encoder: nn.Module,
    processor: MoonViTImageProcessor,
    images: ImageInput | Iterable[ImageInput],
    *,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
    output_device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Encode images of any sizes: one (rows_i * cols_i / 4, 4, D) tensor of merged tokens per image.

    Same arguments as :func:`iter_encode_images`, which this collects.
    """
    return [
        result.tokens
        for result in iter_encode_images(
            encoder, processor, images, max_patches_per_pack=max_patches_per_pack, output_device=output_device
        )
    ]
