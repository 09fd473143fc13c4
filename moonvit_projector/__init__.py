"""projector: MoonViT's merged patches into a language model's token stream.

- :class:`MoonViTProjector` maps the encoder's ``out.merged`` (L / 4, 4, D) to
  (L / 4, text_hidden_size): Kimi-VL's / Kimi-K2.5's projector, Kimi K3's
  ``patchmergerv2``, LocateAnything-3B's ``mlp1``, or a LLaVA-style ``mlp2x_gelu``
  one for training from scratch. The model lives in the library
  (:mod:`moonvit.model.projector`, whose exporters need it) and is re-exported here.
- :func:`splice_visual_tokens` (one placeholder per visual token: Kimi-VL, and
  LocateAnything-3B's ``<IMG_CONTEXT>`` from :func:`locateanything_prompt`) and
  :func:`expand_visual_tokens` (one placeholder per image) put those tokens into
  a language model's ``inputs_embeds``.
- ``python -m moonvit_projector.export`` pre-computes visual tokens for a whole image
  collection (resumable, data-parallel under torchrun); :class:`VisualTokenDataset`
  reads them back for training, and :func:`collate_visual_tokens` packs them into batches.
"""

from moonvit.model.projector import PROJECTOR_TYPES, MoonViTProjector, ProjectorConfig

from .dataset import VisualTokenDataset, collate_visual_tokens
from .prompt import (
    IMG_CONTEXT_TOKEN_ID,
    expand_media_pads,
    k3_image_prompt,
    k3_media_prompts,
    locateanything_image_ids,
    locateanything_prompt,
    media_prompt,
    video_prompt,
)
from .splice import (
    IGNORE_INDEX,
    MEDIA_PAD_TOKEN_ID,
    ExpandedInputs,
    expand_visual_tokens,
    splice_visual_tokens,
    visual_token_counts,
)

__all__ = [
    "IGNORE_INDEX",
    "IMG_CONTEXT_TOKEN_ID",
    "MEDIA_PAD_TOKEN_ID",
    "PROJECTOR_TYPES",
    "ExpandedInputs",
    "MoonViTProjector",
    "ProjectorConfig",
    "VisualTokenDataset",
    "expand_media_pads",
    "collate_visual_tokens",
    "expand_visual_tokens",
    "k3_image_prompt",
    "k3_media_prompts",
    "locateanything_image_ids",
    "locateanything_prompt",
    "media_prompt",
    "splice_visual_tokens",
    "video_prompt",
    "visual_token_counts",
]
