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
    projector_from: str | Path | None = None,
) -> Models:
    """Load the checkpoint (a folder or hub id) and hash the weights as read (before the cast to ``dtype``);
    the encoder runs on attention backend ``attn`` (whether it can run on ``device`` is
    :meth:`Models.attention`'s check). The projector, where ``store`` holds projected tokens, comes from
    ``projector_from`` when given (a folder or hub id), else from the checkpoint; its weights are hashed too."""
    digest = hashlib.sha256()
    try:
        encoder = MoonViT.from_pretrained(checkpoint, device="cpu", attn_implementation=attn)
        update_weights_digest(digest, encoder, "encoder.")
    except CheckpointError as error:
        raise ExportError(f"--checkpoint {checkpoint}: {error}") from error
    projector = None
    if "projected" in store:
        projector = _load_projector(checkpoint, projector_from, encoder)
        update_weights_digest(digest, projector, "projector.")
    processor = MoonViTImageProcessor.from_pretrained(checkpoint, **(processor_overrides or {}))
    video_processor = MoonViTVideoProcessor.from_pretrained(checkpoint)  # frames always resize to the side cap
    encoder = encoder.to(device=device, dtype=dtype).eval()
    projector = projector.to(device=device, dtype=dtype).eval() if projector is not None else None
    return Models(encoder, projector, processor, video_processor, digest.hexdigest())


def _load_projector(checkpoint: str | Path, projector_from: str | Path | None, encoder: MoonViT) -> MoonViTProjector:
    """The projector of ``projector_from`` (or of the checkpoint), refused where it does not take the
    encoder's merged tokens (another width or merge kernel)."""
    flag, source = ("--checkpoint", checkpoint) if projector_from is None else ("--projector-from", projector_from)
    try:
        projector = MoonViTProjector.from_pretrained(source, device="cpu")
    except CheckpointError as error:
        hint = (
            "; --projector-from DIR_OR_HUB_ID reads one from another folder (use --store merged to export without "
            "a projector)"
            if projector_from is None
            else ""
        )
        raise ExportError(f"{flag} {source}: {error}{hint}") from error
    wanted = (encoder.config.hidden_size, encoder.config.merge_kernel_size)
    takes = (projector.config.vision_hidden_size, projector.config.merge_kernel_size)
    if takes != wanted:
        raise ExportError(
            f"{flag} {source}: its projector takes {takes[0]}-wide patches merged {takes[1][0]}x{takes[1][1]}, "
            f"the encoder of --checkpoint {checkpoint} gives {wanted[0]}-wide ones merged {wanted[1][0]}x{wanted[1][1]}"
        )
    return projector
