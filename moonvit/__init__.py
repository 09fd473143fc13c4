"""moonvit: a native-resolution MoonViT vision encoder for VLM and VLA stacks."""

from .checkpoint import CheckpointError
from .config import PRESETS, MoonViTConfig, preset_config
from .grid import PackedGrid, build_packed_grid
from .model import MoonViT, MoonViTOutput
from .packing import (
    DEFAULT_MAX_PATCHES_PER_PACK,
    EncodedImage,
    Pack,
    PackItem,
    encode_images,
    iter_encode_images,
    pack_images,
)
from .processor import (
    ImageBatch,
    ImageLoadError,
    ImagePlan,
    ImageTooLargeError,
    MoonViTImageProcessor,
    image_size,
    load_image,
    patchify,
    unpatchify,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_PATCHES_PER_PACK",
    "CheckpointError",
    "EncodedImage",
    "ImageBatch",
    "ImageLoadError",
    "ImagePlan",
    "ImageTooLargeError",
    "MoonViT",
    "MoonViTConfig",
    "MoonViTImageProcessor",
    "MoonViTOutput",
    "Pack",
    "PackItem",
    "PackedGrid",
    "PRESETS",
    "build_packed_grid",
    "encode_images",
    "image_size",
    "iter_encode_images",
    "load_image",
    "pack_images",
    "patchify",
    "preset_config",
    "unpatchify",
]
