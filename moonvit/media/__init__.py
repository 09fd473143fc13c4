"""Media in: decoding images, the processor's geometry and normalisation, videos, token-budget packing.

:mod:`.image` turns any supported input into an RGB PIL image (or names why it
cannot), :mod:`.processor` resizes, pads, normalises and patchifies
(``pixel_values``, ``grid_hws``), :mod:`.video` samples videos into chunks of up
to 4 frames (Kimi-K2.5), :mod:`.packing` plans packs of whole images and chunks
under a patch budget from their sizes alone, :mod:`.selection` gives a checkpoint's processor
(:func:`processor_for`, any family's).
"""

from .image import (
    IMAGE_EXTENSIONS,
    ImageInput,
    ImageLoadError,
    ImageTooLargeError,
    image_size,
    image_sources,
    is_image,
    load_image,
)
from .packing import DEFAULT_MAX_PATCHES_PER_PACK, Pack, PackItem, group_into_packs, pack_images, plan_pack_item
from .processor import (
    ImageBatch,
    ImagePlan,
    ImageProcessor,
    ImageSizeError,
    MoonViTImageProcessor,
    patchify,
    unpatchify,
)
from .selection import processor_for, register_processor_loader
from .video import (
    VIDEO_EXTENSIONS,
    MoonViTVideoProcessor,
    VideoBatch,
    VideoFrames,
    VideoLoadError,
    VideoNotSupportedError,
    is_video,
)

__all__ = [
    "DEFAULT_MAX_PATCHES_PER_PACK",
    "IMAGE_EXTENSIONS",
    "ImageBatch",
    "ImageInput",
    "ImageLoadError",
    "ImagePlan",
    "ImageProcessor",
    "ImageSizeError",
    "ImageTooLargeError",
    "VIDEO_EXTENSIONS",
    "VideoBatch",
    "VideoFrames",
    "VideoLoadError",
    "VideoNotSupportedError",
    "MoonViTImageProcessor",
    "MoonViTVideoProcessor",
    "Pack",
    "PackItem",
    "group_into_packs",
    "image_size",
    "image_sources",
    "is_image",
    "is_video",
    "load_image",
    "pack_images",
    "patchify",
    "plan_pack_item",
    "processor_for",
    "register_processor_loader",
    "unpatchify",
]
