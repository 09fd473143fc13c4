"""The export's models: the encoder, the projector when projected tokens are stored, the processors.

Any registered tower exports: MoonViT (merged 2x2 groups, a projector in its folder) and the ViT
tower (ViT, DeiT, SigLIP, DINOv2: each patch one token, no merger; its prefix rows and pooled vector
stored per image). A ViT folder holds no projector: its tokens export as ``--store merged``, or
projected by a projector read with ``--projector-from`` that takes its width and one patch per token.
OpenVLA's fused backbone carries its projector (Prismatic's MLP, read with the towers): its features
(n, 1, 2176) export as ``merged``, its LLM tokens as ``projected`` (:class:`TowerProjector`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from moonvit import ImageProcessor, MoonViT, VisionEncoder
from moonvit.encode import checkpoint_processors
from moonvit.media.video import MoonViTVideoProcessor
from moonvit.model.attention import resolve_attn_implementation
from moonvit.model.interface import pooled_kind, prefix_token_count, tower_name, tower_projection
from moonvit.weights.checkpoint import CheckpointError, update_weights_digest

from ..model import MoonViTProjector
from .settings import ExportError

__all__ = ["Models", "TowerProjector", "load_models"]


@dataclass(frozen=True)
class TowerProjectorConfig:
    """What ``run.json`` records of a :class:`TowerProjector`: whose it is and its widths (its weights are
    the encoder's, hashed with them)."""

    tower: str
    vision_hidden_size: int
    text_hidden_size: int
    source: str = "the encoder's own"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TowerProjector:
    """The projector a tower carries itself (OpenVLA's fused backbone: Prismatic's MLP), called on merged
    tokens (n, 1, D) -> (n, T) as :class:`MoonViTProjector` is (see
    :func:`~moonvit.model.interface.tower_projection`); on the encoder's device and dtype."""

    projection: Callable[[torch.Tensor], torch.Tensor]
    config: TowerProjectorConfig

    def __call__(self, merged: torch.Tensor) -> torch.Tensor:
        return self.projection(merged)


@dataclass
class Models:
    """The encoder, the projector (None when only merged tokens are stored) and the processor."""

    encoder: VisionEncoder
    projector: MoonViTProjector | TowerProjector | None
    processor: ImageProcessor
    video_processor: MoonViTVideoProcessor
    checkpoint_sha256: str

    @property
    def prefix_tokens(self) -> int:
        """The encoder's prefix tokens per image (CLS, then DeiT's distillation token or DINOv2's
        registers), stored beside the tokens: 0 for MoonViT and SigLIP."""
        return prefix_token_count(self.encoder.config)

    @property
    def pooled(self) -> str | None:
        """What the encoder's pooled vector per image is (``cls``, ``mean``, ``map``: see
        :func:`~moonvit.model.interface.pooled_kind`), stored beside the tokens; None for MoonViT."""
        return pooled_kind(self.encoder.config)

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
    ``projector_from`` when given (a folder or hub id), else from the checkpoint; its weights are hashed too.
    A tower that carries its projector (OpenVLA's fused backbone) projects with it where no
    ``projector_from`` is given: its weights are the encoder's, already hashed."""
    digest = hashlib.sha256()
    try:
        encoder = MoonViT.from_pretrained(checkpoint, device="cpu", attn_implementation=attn)
        update_weights_digest(digest, encoder, "encoder.")
    except CheckpointError as error:
        raise ExportError(f"--checkpoint {checkpoint}: {error}") from error
    projector = None
    own = "projected" in store and projector_from is None and tower_projection(encoder) is not None
    if "projected" in store and not own:
        projector = _load_projector(checkpoint, projector_from, encoder)
        update_weights_digest(digest, projector, "projector.")
    # the folder's own processors (a classic ViT's: its patch size, no merger); frames always resize to the side cap
    processors = checkpoint_processors(checkpoint, encoder.config, **(processor_overrides or {}))
    processor, video_processor = processors.image, processors.video
    encoder = encoder.to(device=device, dtype=dtype).eval()
    projected: MoonViTProjector | TowerProjector | None = _tower_projector(encoder) if own else projector
    if isinstance(projected, MoonViTProjector):
        projected = projected.to(device=device, dtype=dtype).eval()
    return Models(encoder, projected, processor, video_processor, digest.hexdigest())


def _tower_projector(encoder: VisionEncoder) -> TowerProjector:
    projection = tower_projection(encoder)
    assert projection is not None  # asked before
    config = encoder.config
    width = int(cast(Any, config).text_hidden_size)  # an int where tower_projection gives a projection
    return TowerProjector(projection, TowerProjectorConfig(tower_name(config), config.hidden_size, width))


def _load_projector(
    checkpoint: str | Path, projector_from: str | Path | None, encoder: VisionEncoder
) -> MoonViTProjector:
    """The projector of ``projector_from`` (or of the checkpoint), refused where it does not take the
    encoder's merged tokens (another width or merge kernel). A ViT tower's folder (no merger) holds
    none: without ``projector_from`` that is an error that says what to do instead."""
    flag, source = ("--checkpoint", checkpoint) if projector_from is None else ("--projector-from", projector_from)
    config = encoder.config
    if projector_from is None and config.tokens_per_merge == 1:  # a tower without a merger: a ViT tower's folder
        raise ExportError(
            f"--checkpoint {checkpoint} holds a {tower_name(config)}, which comes without a projector: export "
            f"its tokens with --store merged (one {config.hidden_size}-wide token per patch, its prefix rows "
            f"and pooled vector beside them), or add --projector-from DIR_OR_HUB_ID with a projector that "
            f"takes {config.hidden_size}-wide tokens of one patch (merge_kernel_size 1x1)"
        )
    try:
        projector = MoonViTProjector.from_pretrained(source, device="cpu")
    except CheckpointError as error:
        if projector_from is None:
            hint = (
                "; --projector-from DIR_OR_HUB_ID reads one from another folder (use --store merged to export "
                "without a projector)"
            )
        else:
            tower = _tower_without_merger(source)
            hint = "" if tower is None else f" (it holds a {tower}, which comes without a projector)"
        raise ExportError(f"{flag} {source}: {error}{hint}") from error
    wanted = (config.hidden_size, config.merge_kernel_size)
    takes = (projector.config.vision_hidden_size, projector.config.merge_kernel_size)
    if takes != wanted:
        raise ExportError(
            f"{flag} {source}: its projector takes {takes[0]}-wide patches merged {takes[1][0]}x{takes[1][1]}, "
            f"the encoder of --checkpoint {checkpoint} gives {wanted[0]}-wide ones merged {wanted[1][0]}x{wanted[1][1]}"
            + (f" (a {tower_name(config)}: no merger, each patch one token)" if config.tokens_per_merge == 1 else "")
        )
    return projector


def _tower_without_merger(source: str | Path) -> str | None:
    """What a message calls the tower of a local folder whose tower has no merger (a ViT's: its folders
    hold no projector), read from its ``config.json``; None for any other folder or one that cannot be read."""
    from moonvit.weights.checkpoint import read_config

    try:
        with warnings.catch_warnings():  # its unread config keys are not this message's business
            warnings.simplefilter("ignore")
            config, _ = read_config(Path(source))
    except (OSError, ValueError, CheckpointError):
        return None
    return tower_name(config) if config.tokens_per_merge == 1 else None
