"""The frozen encoder under evaluation: built from a checkpoint folder or a random-init preset, and hashed.

Any registered tower: a MoonViT folder or preset, or a classic ViT / DeiT folder (transformers',
timm's or this package's), read at native resolution with its patch size and no merger."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moonvit import ImageProcessor, MoonViT, VisionEncoder, preset_processors
from moonvit.encode import checkpoint_processors
from moonvit.weights.checkpoint import update_weights_digest
from moonvit.weights.hub import source_label

__all__ = ["FrozenEncoder", "load_frozen_encoder", "weights_hash"]


@dataclass(frozen=True)
class FrozenEncoder:
    """An encoder in eval mode with its processor and identity.

    Attributes:
        model: the encoder, in eval mode, gradients off (MoonViT or the classic ViT / DeiT).
        processor: the checkpoint's image processor (a preset's: its family rule; a classic ViT's:
            its patch size, no merger).
        source: ``checkpoint:PATH`` or ``preset:NAME`` (random init, seed).
        hash: sha256 identifying the weights (see :func:`weights_hash`).
    """

    model: VisionEncoder
    processor: ImageProcessor
    source: str
    hash: str

    @property
    def num_parameters(self) -> int | None:
        """The encoder's parameter count (None for an encoder that is not a torch module)."""
        model = self.model
        return sum(p.numel() for p in model.parameters()) if isinstance(model, torch.nn.Module) else None


def weights_hash(model: torch.nn.Module, prefix: str = "") -> str:
    """sha256 over ``prefix`` and the state dict: every tensor's name, dtype, shape and bytes, in sorted key order."""
    digest = hashlib.sha256(prefix.encode())
    update_weights_digest(digest, model)
    return digest.hexdigest()


def load_frozen_encoder(
    *,
    checkpoint: str | Path | None = None,
    preset: str | None = None,
    random_init: bool = False,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    side_limit_mode: str | None = None,
    image_rule: str | None = None,
    attn: str | None = None,
) -> FrozenEncoder:
    """Load a checkpoint folder or hub id, or build a preset with weights drawn after ``torch.manual_seed(seed)``.

    Exactly one of ``checkpoint`` and ``preset`` is given; presets have no trained weights, so they
    need ``random_init``. A preset's hash covers its name and seed as well as the weights.
    ``side_limit_mode`` replaces the processor's setting when given; ``image_rule`` names a classic ViT /
    DeiT folder's processor rule (None: native); ``attn``, when given, the encoder's attention backend.

    Raises:
        ValueError: both or neither source, or a preset without ``random_init``.
    """
    if (checkpoint is None) == (preset is None):
        raise ValueError("give exactly one of a checkpoint folder or a preset name")
    overrides: dict[str, Any] = {} if side_limit_mode is None else {"side_limit_mode": side_limit_mode}
    if checkpoint is not None:
        model = MoonViT.from_pretrained(checkpoint, dtype=dtype, device=device)  # any registered tower
        processor = checkpoint_processors(checkpoint, model.config, rule=image_rule, **overrides).image
        source, prefix = f"checkpoint:{source_label(checkpoint)}", "checkpoint"
    else:
        assert preset is not None
        if not random_init:
            raise ValueError(f"preset {preset!r} has no trained weights; pass --random-init to probe a random encoder")
        if image_rule is not None:
            raise ValueError(f"image rule {image_rule!r}: a checkpoint's processor rule; a preset reads its family's")
        torch.manual_seed(seed)
        model = MoonViT.from_preset(preset).to(device=device, dtype=dtype)
        processor = preset_processors(preset, **overrides).image  # the preset's family rule
        source, prefix = f"preset:{preset} (random init, seed {seed})", f"preset:{preset}:seed:{seed}"
    if attn is not None:
        model.set_attn_implementation(attn)
    model.eval().requires_grad_(False)
    return FrozenEncoder(model, processor, source, weights_hash(model, prefix))
