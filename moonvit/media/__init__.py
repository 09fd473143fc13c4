"""Media in: decoding images, the processor's geometry and normalisation, token-budget packing.

:mod:`.image` turns any supported input into an RGB PIL image (or names why it
cannot), :mod:`.processor` resizes, pads, normalises and patchifies
(``pixel_values``, ``grid_hws``), :mod:`.packing` plans packs of whole images
under a patch budget from their sizes alone.
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
from .processor import ImageBatch, ImagePlan, ImageSizeError, MoonViTImageProcessor, patchify, unpatchify

__all__ = [
    "DEFAULT_MAX_PATCHES_PER_PACK",
    "IMAGE_EXTENSIONS",
    "ImageBatch",
    "ImageInput",
    "ImageLoadError",
    "ImagePlan",
    "ImageSizeError",
    "ImageTooLargeError",
    "MoonViTImageProcessor",
    "Pack",
    "PackItem",
    "group_into_packs",
    "image_size",
    "image_sources",
    "is_image",
    "load_image",
    "pack_images",
    "patchify",
    "plan_pack_item",
    "unpatchify",
]
