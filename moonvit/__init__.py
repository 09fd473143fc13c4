"""moonvit: a native-resolution MoonViT vision encoder for VLM and VLA stacks.

Layout, by role:
    moonvit.model    the network (config, grid metadata, position table, RoPE,
                     attention backends, blocks, the encoder, the projector)
    moonvit.media    media in (image decoding, the processor, token-budget packing)
    moonvit.weights  weight formats (checkpoint folders, transformers interop)
    moonvit.encode   packs through the encoder, outputs split per image
    moonvit.cli      the shared command-line vocabulary
"""

# first, before torch loads: the commands' OpenMP wait policy (see moonvit.environment)
from . import environment  # noqa: F401
from .encode import (
    EncodedImage,
    EncodedImages,
    EncodedPack,
    encode_images,
    encode_pack,
    iter_encode_images,
    pool_features,
)
from .media.image import IMAGE_EXTENSIONS, ImageLoadError, ImageTooLargeError, image_size, load_image
from .media.packing import DEFAULT_MAX_PATCHES_PER_PACK, Pack, PackItem, pack_images
from .media.presets import preset_processors
from .media.processor import (
    ImageBatch,
    ImagePlan,
    ImageProcessor,
    ImageSizeError,
    MoonViTImageProcessor,
    patchify,
    unpatchify,
)
from .media.selection import processor_for
from .media.video import MoonViTVideoProcessor, VideoBatch, VideoFrames, VideoLoadError, VideoNotSupportedError
from .model.config import PRESETS, MoonViTConfig, preset_config
from .model.encoder import MoonViT, MoonViTOutput
from .model.grid import PackedGrid, build_packed_grid, tokens_per_image
from .model.interface import VisionEncoder
from .model.lora import LoRAConfig, apply_lora, merge_lora
from .model.projector import MoonViTProjector, ProjectorConfig
from .weights.storage import CheckpointError

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_PATCHES_PER_PACK",
    "IMAGE_EXTENSIONS",
    "PRESETS",
    "CheckpointError",
    "EncodedImage",
    "EncodedImages",
    "EncodedPack",
    "ImageBatch",
    "ImageLoadError",
    "ImagePlan",
    "ImageProcessor",
    "ImageSizeError",
    "ImageTooLargeError",
    "LoRAConfig",
    "MoonViT",
    "MoonViTConfig",
    "MoonViTImageProcessor",
    "MoonViTOutput",
    "MoonViTProjector",
    "MoonViTVideoProcessor",
    "Pack",
    "PackItem",
    "PackedGrid",
    "ProjectorConfig",
    "VideoBatch",
    "VideoFrames",
    "VideoLoadError",
    "VideoNotSupportedError",
    "VisionEncoder",
    "apply_lora",
    "build_packed_grid",
    "encode_images",
    "encode_pack",
    "image_size",
    "iter_encode_images",
    "load_image",
    "merge_lora",
    "pack_images",
    "patchify",
    "pool_features",
    "preset_config",
    "preset_processors",
    "processor_for",
    "tokens_per_image",
    "unpatchify",
]
