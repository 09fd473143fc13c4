"""The classic ViT and DeiT (:class:`~moonvit.families.vit.ClassicViT`) in the trainer.

What differs from a MoonViT tower, in one place:

- **where it comes from**: a preset of :data:`~moonvit.families.vit.PRESETS` (``--preset vit-tiny``,
  its shape overridable by ``--depth`` / ``--width`` / ``--heads`` / ``--mlp-width``) or any folder
  the package reads as one (transformers', timm's, this package's own);
- **its processor**: a folder's is the one the commands read it with
  (:func:`moonvit.encode.checkpoint_processors`: its family's default rule, NaFlex's for SigLIP2, the
  native rule with the folder's normalisation for the others, ImageNet's where a DINOv2 folder has no
  file), a preset's the native rule with the preset's mean and std (ImageNet's for DeiT, 0.5 for the
  ViT paper's); the trainer's images are cut into ``patch_size`` squares with no merger and the plan
  rounds sizes to whole patches (merge kernel 1x1);
- **the higher-resolution fine-tune** (``--image-size``; ViT paper §6.3 / DeiT): the 1D table is
  resampled once, by the tower's own rule, to the new native grid, which the saved checkpoint keeps;
- **its classifier**: the tower's own head(s) when it has them, refitted to the dataset's classes
  (a fresh zero-initialised ``D x K`` layer, the ViT paper's fine-tuning recipe) when the count differs;
- **what of it trains**: ``--freeze tower`` keeps the tower's head(s) training (a linear probe),
  ``--freeze-blocks N`` also freezes the prefix tokens (CLS, the distillation token, the registers) and
  the table; a block's LayerScale is its block's. transformers' pooler, which no objective reads, stays
  as loaded, and so does the MAP head (SigLIP's ``attn_pool``) where the objective reads no ``pooled``
  (feature distillation, DeiT's two heads) (:func:`freeze_unread`); where it does read it, the MAP head
  is the tower's top, above its blocks as the final norm is: frozen by ``--freeze tower`` (the probe
  reads the frozen tower's own pooled embedding), trained by ``--freeze-blocks N``. LoRA and
  ``--save-layout release`` are MoonViT's and refused here, naming the alternative.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from moonvit import MoonViT, MoonViTConfig, MoonViTImageProcessor
from moonvit.encode import checkpoint_processors
from moonvit.families.vit import PRESETS as CLASSIC_PRESETS
from moonvit.families.vit import ClassicViT, ClassicViTConfig, classic_vit_config
from moonvit.families.vit.processor import NativeViTImageProcessor

if TYPE_CHECKING:
    from .config import ModelSection

__all__ = [
    "CLASSIC_PRESETS",
    "HEAD_NAMES",
    "Encoder",
    "EncoderConfig",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ClassicViT",
    "classic_processor",
    "classic_tower",
    "follow_table",
    "TOKEN_NAMES",
    "fit_heads",
    "freeze_unread",
    "head_parameter",
    "is_classic",
    "processor_of",
    "resize_table",
    "select_trainable_classic",
    "tower_blocks",
]

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
"""DeiT's (and timm's default) normalisation; the ViT paper's checkpoints take 0.5, 0.5."""
PRESET_NORMALISATION: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "deit-base-distilled-16": (IMAGENET_MEAN, IMAGENET_STD)
}
"""The presets whose checkpoints normalise otherwise than with mean and std 0.5."""
Encoder = MoonViT | ClassicViT
"""The towers the trainer trains."""
EncoderConfig = MoonViTConfig | ClassicViTConfig
HEAD_NAMES = ("head", "head_dist")
"""The tower's classifier modules: trained as the objective's head (``--head-lr``, never frozen by ``--freeze``)."""
TOKEN_NAMES = ("cls_token", "dist_token", "reg_token")
"""The tower's prefix-token parameters (CLS, DeiT's distillation token, DINOv2's registers): embeddings, frozen by
``--freeze-blocks``, not weight-decayed, at depth 0 for layer-wise decay."""


class ClassicError(ValueError):
    """A setting the classic ViT cannot take (the message names the flag and what to use instead)."""


def is_classic(model: Any) -> bool:
    """Whether ``model`` (a tower or its config) is a classic ViT / DeiT."""
    return isinstance(model, (ClassicViT, ClassicViTConfig))


def tower_blocks(encoder: nn.Module) -> nn.ModuleList:
    """The tower's transformer blocks, in order (``blocks`` of a classic ViT, ``encoder.blocks`` of a MoonViT)."""
    blocks = encoder.blocks if is_classic(encoder) else encoder.encoder.blocks  # type: ignore[union-attr]
    assert isinstance(blocks, nn.ModuleList)
    return blocks


# ---- building ----------------------------------------------------------------------------------


def classic_tower(model: ModelSection, loaded: ClassicViT | None) -> ClassicViT:
    """The tower to train: ``loaded`` (a ``--checkpoint``) rebuilt with ``--drop-path`` and its weights, or
    ``--preset``'s, randomly initialised from torch's current generator; either at ``--image-size`` when given.

    Raises:
        ClassicError: a shape flag a classic ViT has no field for, or an image size off the patch grid.
    """
    if loaded is not None:
        tower = ClassicViT(dataclasses.replace(loaded.config, drop_path_rate=model.drop_path))
        tower.load_state_dict(loaded.state_dict())
        if model.image_size is not None:
            resize_table(tower, model.image_size)
        return tower
    if model.pos_emb_size is not None:
        raise ClassicError(
            f"--pos-emb-size shapes a MoonViT's 2D table; {model.preset}'s 1D table follows --image-size "
            "(its side in px, a multiple of the patch)"
        )
    overrides = model.shape_overrides(image_size=model.image_size)
    assert model.preset is not None
    try:
        return ClassicViT(classic_vit_config(model.preset, drop_path_rate=model.drop_path, **overrides))
    except ValueError as error:
        raise ClassicError(f"--preset {model.preset} with {overrides}: {error}") from error


def resize_table(tower: ClassicViT, image_size: int) -> None:
    """Resample the tower's table to ``image_size`` px once (its native grid from now on; nothing when it is
    already there): the higher-resolution fine-tune of the ViT paper (§6.3) and DeiT (224 -> 384 px)."""
    if image_size == tower.config.image_size:
        return
    try:
        tower.resize_position_table(image_size)
    except ValueError as error:
        raise ClassicError(f"--image-size {image_size}: {error}") from error


def classic_processor(config: ClassicViTConfig, folder: str | None = None, preset: str | None = None) -> Any:
    """The processor the trainer renders a classic ViT's images with, and saves beside its checkpoint.

    A folder's (or hub id's) is the commands' choice, :func:`moonvit.encode.checkpoint_processors`: its
    family's default rule (SigLIP2's NaFlex; the native rule for the classic ViT, SigLIP and DINOv2) with the
    folder's own normalisation and filter, else the rule's (ImageNet's for DINOv2). A preset has no files: the
    native rule (``patch_size`` patches, no merger, no padding) with the preset's mean and std (0.5 but for
    :data:`PRESET_NORMALISATION`).

    Raises:
        CheckpointError: the folder's processor files cannot be read.
    """
    if folder is None:
        mean, std = PRESET_NORMALISATION.get(preset or "", ((0.5,) * 3, (0.5,) * 3))
        return NativeViTImageProcessor(patch_size=config.patch_size, image_mean=mean, image_std=std)
    return checkpoint_processors(folder, config).image


def follow_table(processor: Any, before: ClassicViTConfig, after: ClassicViTConfig) -> Any:
    """``processor`` for the tower ``--image-size`` resampled from ``before``'s table to ``after``'s: the
    native rule's patch budget keeps its multiple of the native grid (4 x 4 x 4 patches at 64 px, patch 16,
    become 4 x 6 x 6 at 96 px); other rules unchanged (NaFlex's budget is not the table's)."""
    if not isinstance(processor, NativeViTImageProcessor) or before.grid_side == after.grid_side:
        return processor
    budget = processor.in_token_limit * after.grid_side**2 // before.grid_side**2
    return dataclasses.replace(processor, in_token_limit=max(1, budget))


def processor_of(tower: Any, folder: str | Path | None, preset: str | None = None) -> MoonViTImageProcessor:
    """The processor a tower's images are rendered with: a classic ViT's (:func:`classic_processor`), or a MoonViT
    folder's ``preprocessor_config.json`` (the defaults for a preset or a folder without one).

    Raises:
        CheckpointError: a processor file that cannot be read.
    """
    if is_classic(tower):
        return classic_processor(tower.config, None if folder is None else str(folder), preset)
    return MoonViTImageProcessor() if folder is None else MoonViTImageProcessor.from_pretrained(folder)


# ---- the classifier ----------------------------------------------------------------------------


def fit_heads(tower: ClassicViT, classes: int, distilled: bool = False) -> bool:
    """Give ``tower`` head(s) of ``classes`` outputs, in place: its own kept when they have that many, else
    new zero-initialised ones (the ViT paper's fine-tuning head). ``distilled``: DeiT's two heads, the
    second on the distillation token (which the tower must have). Returns whether it built new heads.

    The config follows (``num_classes``, ``distilled_head``), so the saved checkpoint holds the new head.
    """
    config = tower.config
    if distilled and not config.distillation_token:
        raise ClassicError("two heads need the distillation token")
    if config.num_classes == classes and config.distilled_head == distilled:
        return False
    device = tower.patch_embed.proj.weight.device
    config.num_classes, config.distilled_head = classes, distilled
    tower.head = _zero_linear(config.hidden_size, classes, device)
    tower.head_dist = _zero_linear(config.hidden_size, classes, device) if distilled else None
    return True


def _zero_linear(width: int, classes: int, device: torch.device) -> nn.Linear:
    layer = nn.Linear(width, classes, device=device)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def head_parameter(name: str) -> bool:
    """Whether a tower parameter's name is one of its classifier heads'."""
    return name.split(".", 1)[0] in HEAD_NAMES


def freeze_unread(tower: ClassicViT, *, pooled: bool, heads: bool) -> None:
    """Keep as loaded, in place, what of ``tower`` the objective's loss never reaches: the MAP head unless the loss
    reads ``out.pooled`` (``pooled``), the classifier head(s) unless it reads them (``heads``).

    Such a weight would only drift under weight decay, and stall DDP, whose reduction waits for a gradient of every
    parameter that requires one.
    """
    if not pooled and tower.attn_pool is not None:
        tower.attn_pool.requires_grad_(False)
    if not heads:
        for name, param in tower.named_parameters():
            if head_parameter(name):
                param.requires_grad_(False)


# ---- what trains ---------------------------------------------------------------------------------


def select_trainable_classic(tower: ClassicViT, model: ModelSection) -> None:
    """``--freeze tower`` (every weight but the heads', the MAP head's too) or ``--freeze-blocks N`` (the patch
    embedding, the prefix tokens, the table and the first N blocks with their LayerScales), in place; frozen blocks
    lose their stochastic depth.

    Raises:
        ClassicError: ``--lora-rank`` (MoonViT's linears' names), or more blocks than the tower has.
    """
    blocks = tower.blocks
    if tower.pooler is not None:
        # transformers' pooler (dense + tanh on the CLS row) feeds no head and no loss: kept as loaded, and out of
        # DDP's reduction (which a parameter that never gets a gradient would stall)
        tower.pooler.requires_grad_(False)
    if model.lora_rank is not None:
        raise ClassicError(
            "--lora-rank adapts a MoonViT's linears (wqkv, wo, fc0, fc1); a classic ViT fine-tunes all of it, "
            "or the later blocks with --freeze-blocks N, or its head alone with --freeze tower"
        )
    if model.freeze == "tower":
        for name, param in tower.named_parameters():
            param.requires_grad_(head_parameter(name))
        frozen = len(blocks)
    elif model.freeze_blocks is not None:
        frozen = model.freeze_blocks
        if frozen > len(blocks):
            raise ClassicError(
                f"--freeze-blocks {frozen}: the tower has {len(blocks)} blocks (--freeze tower freezes all of "
                "them and the final norm, the head training)"
            )
        tower.patch_embed.requires_grad_(False)
        tower.pos_embed.requires_grad_(False)
        for name in TOKEN_NAMES:
            token = getattr(tower, name)
            if token is not None:
                token.requires_grad_(False)
        for block in blocks[:frozen]:
            block.requires_grad_(False)
    else:
        return
    for block in blocks[:frozen]:
        block.drop_path = 0.0  # type: ignore[assignment]
