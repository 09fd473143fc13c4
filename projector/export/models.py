"""The export's models: the encoder, the projector when projected tokens are stored, the processors."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moonvit import MoonViT, MoonViTImageProcessor, VisionEncoder
from moonvit.media.video import MoonViTVideoProcessor
from moonvit.model.attention import resolve_attn_implementation
from moonvit.weights.checkpoint import CheckpointError, update_weights_digest

from ..model import MoonViTProjector
from .settings import ExportError

__all__ = ["Models", "load_models"]


@dataclass
class Models:
    """The encoder, the projector (None when only merged tokens are stored) and the processor."""

    encoder: VisionEncoder
    projector: MoonViTProjector | None
    processor: MoonViTImageProcessor
    video_processor: MoonViTVideoProcessor
    checkpoint_sha256: str

    def attention(self, device: torch.device) -> str:
        """The attention backend the encoder runs on ``device`` (``auto`` resolved: OpenVINO's where it is
        installed, on a bf16 CPU): part of what the tokens' bytes depend on."""
        return resolve_attn_implementation(self.encoder.config.attn_implementation, device, self.encoder.dtype)


def load_models(
    checkpoint: str | Path,
    store: Sequence[str],
    dtype: torch.dtype,
    device: torch.device,
    processor_overrides: dict[str, Any] | None = None,
    attn: str = "auto",
) -> Models:
    """Load the checkpoint (a folder or hub id) and hash the weights as read (before the cast to ``dtype``);
    the encoder runs on attention backend ``attn`` (whether it can run on ``device`` is
    :meth:`Models.attention`'s check)."""
    digest = hashlib.sha256()
    try:
        encoder = MoonViT.from_pretrained(checkpoint, device="cpu", attn_implementation=attn)
        update_weights_digest(digest, encoder, "encoder.")
        projector = None
        if "projected" in store:
            projector = MoonViTProjector.from_pretrained(checkpoint, device="cpu")
            update_weights_digest(digest, projector, "projector.")
    except CheckpointError as error:
        hint = " (use --store merged to export without a projector)" if "projected" in store else ""
        raise ExportError(f"--checkpoint {checkpoint}: {error}{hint}") from error
    processor = MoonViTImageProcessor.from_pretrained(checkpoint, **(processor_overrides or {}))
    video_processor = MoonViTVideoProcessor.from_pretrained(checkpoint)  # frames always resize to the side cap
    encoder = encoder.to(device=device, dtype=dtype).eval()
    projector = projector.to(device=device, dtype=dtype).eval() if projector is not None else None
    return Models(encoder, projector, processor, video_processor, digest.hexdigest())
