"""Token-budget packing of long image lists.

:func:`pack_images` groups images, in input order and each one whole, into packs of at most
``max_patches_per_pack`` patches, planning every image from its size alone (file headers, not
pixels). :mod:`moonvit.encode` then decodes and encodes one pack at a time, so the encoder's
working set is bounded by the budget, not by the length of the list.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .image import ImageInput, image_size, image_sources
from .processor import ImagePlan, ImageProcessor, ImageSizeError
from .video import MoonViTVideoProcessor, VideoChunk, VideoSource, is_video

MediaInput = ImageInput | VideoSource
"""An image input, or a video (a file path with a video ending, or VideoFrames)."""

__all__ = [
    "DEFAULT_MAX_PATCHES_PER_PACK",
    "Pack",
    "PackItem",
    "group_into_packs",
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
    """One item of a pack: an image, or one chunk of a video.

    Attributes:
        index: position in the input (a video's chunks share it).
        source: the image input, decoded only when its pack is processed, or a
            :class:`~moonvit.media.video.VideoChunk`.
        plan: its geometry through the processor (a chunk's: each frame's).
        in_token_limit: the reduced size budget it was planned with because, alone, it exceeded
            the pack budget; None when the processor's own rule applies.
    """

    index: int
    source: ImageInput | VideoChunk
    plan: ImagePlan
    in_token_limit: int | None

    @property
    def rescaled(self) -> bool:
        return self.in_token_limit is not None

    @property
    def chunk(self) -> VideoChunk | None:
        """The video chunk this item is, or None for an image."""
        return self.source if isinstance(self.source, VideoChunk) else None

    @property
    def frames(self) -> int:
        """t: 1 for an image, the chunk's frames for a video chunk."""
        return 1 if self.chunk is None else self.chunk.plan.frames

    @property
    def num_patches(self) -> int:
        """t * h * w, the encoder rows the item takes."""
        return self.frames * self.plan.num_patches

    @property
    def key(self) -> tuple[int, int | None]:
        """(input position, chunk position or None): unique among a run's items."""
        return (self.index, None if self.chunk is None else self.chunk.plan.chunk)


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
        return sum(item.num_patches for item in self.items)


def pack_images(
    images: MediaInput | Iterable[MediaInput],
    processor: ImageProcessor,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
    video_processor: MoonViTVideoProcessor | None = None,
) -> Iterator[Pack]:
    """Greedily group ``images`` (and videos) into packs of at most ``max_patches_per_pack`` patches.

    Packs come in input order and each image or video chunk lies whole in one pack; a video
    (a file with a video ending, or :class:`~moonvit.media.video.VideoFrames`) becomes its chunks,
    planned by ``video_processor`` (default: :meth:`MoonViTVideoProcessor.for_images` of
    ``processor``). ``images`` is consumed lazily, one input ahead of the pack being yielded;
    only sizes are read (file headers, array shapes, container metadata). An item whose padded
    grid alone exceeds the budget gets the largest ``in_token_limit`` whose grid fits, recorded
    in its :class:`PackItem`.

    Raises:
        ImageLoadError: an input cannot be read; the message gives its position.
        ValueError: the budget is below one merged token, or an image cannot be made to fit it
            (or exceeds the position table, see :meth:`MoonViTImageProcessor.plan_image`).
    """
    group = processor.merge_kernel_size[0] * processor.merge_kernel_size[1]
    if max_patches_per_pack < group:
        raise ValueError(f"max_patches_per_pack must hold at least one merged token ({group} patches)")
    videos = video_processor or MoonViTVideoProcessor.for_images(processor)

    def items() -> Iterator[PackItem]:
        for index, source in enumerate(image_sources(images)):  # type: ignore[arg-type]
            if is_video(source):
                yield from plan_video_items(index, source, videos, max_patches_per_pack)  # type: ignore[arg-type]
            else:
                yield plan_pack_item(index, source, processor, max_patches_per_pack)

    yield from group_into_packs(items(), max_patches_per_pack)


def group_into_packs(items: Iterable[PackItem], max_patches_per_pack: int) -> Iterator[Pack]:
    """Consecutive runs of ``items`` of at most ``max_patches_per_pack`` patches each, consumed lazily."""
    group: list[PackItem] = []
    total = 0
    for item in items:
        if group and total + item.num_patches > max_patches_per_pack:
            yield Pack(tuple(group))
            group, total = [], 0
        group.append(item)
        total += item.num_patches
    if group:
        yield Pack(tuple(group))


def plan_pack_item(index: int, source: ImageInput, processor: ImageProcessor, budget: int) -> PackItem:
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
        index,
        *size,
        *plan.resized_size,
        plan.num_patches,
        budget,
    )
    return PackItem(index, source, plan, limit)


def plan_video_items(index: int, source: VideoSource, processor: MoonViTVideoProcessor, budget: int) -> list[PackItem]:
    """A video's chunks as pack items, from its metadata alone; every frame of a chunk whose
    t * h * w alone exceeds ``budget`` is scaled down to fit (one per-frame limit for the video).

    Raises:
        ImageLoadError (VideoLoadError), ValueError: the video cannot be read or planned, the
            message prefixed with the input position.
    """
    try:
        chunks = processor.chunks(source)
        info = chunks[0].info
        plan = processor.plan_frame(info)
        longest = max(chunk.plan.frames for chunk in chunks)
        limit = None
        if longest * plan.num_patches > budget:
            limit = _fit_token_limit(processor.frame_processor, info.size, budget // longest)
            plan = processor.plan_frame(info, limit)
            logger.info("video %d: frames scaled to %dx%d px to fit max_patches_per_pack=%d", index,
                        *plan.resized_size, budget)  # fmt: skip
    except ValueError as error:  # VideoLoadError included: keep the type, add the position
        raise type(error)(f"input video {index}: {error}") from error
    return [PackItem(index, chunk, plan, limit) for chunk in chunks]


def _fit_token_limit(processor: ImageProcessor, size: tuple[int, int], budget: int) -> int:
    """Largest ``in_token_limit`` whose padded grid has at most ``budget`` patches.

    Assumes the processor's own limit does not fit. The padded patch count never decreases as
    the limit grows, so a bisection finds it.
    """

    def fits(limit: int) -> bool:
        return processor.plan_image(*size, in_token_limit=limit).num_patches <= budget

    if not fits(1):
        smallest = processor.plan_image(*size, in_token_limit=1).num_patches
        raise ImageSizeError(
            f"a {size[0]}x{size[1]} image needs at least {smallest} patches after padding, over "
            f"max_patches_per_pack={budget}"
        )
    low, high = 1, processor.in_token_limit  # fits(low) and not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
