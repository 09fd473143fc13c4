"""Building a run from its config: the encoder (and the processor it expects) with what of it trains,
the plan of packs and the step count of an ``--epochs`` run."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from moonvit import CheckpointError, MoonViT, MoonViTImageProcessor, preset_config, preset_processors
from moonvit.distributed import Ranks
from moonvit.model.blocks import Block
from moonvit.model.interface import tower_name
from moonvit.model.lora import LoRAConfig, apply_lora

from .batch import ImageSource
from .classic import (
    CLASSIC_PRESETS,
    ClassicError,
    ClassicViT,
    Encoder,
    EncoderConfig,
    classic_processor,
    classic_tower,
    follow_table,
    is_classic,
    processor_of,
    select_trainable_classic,
)
from .config import ModelSection, TrainConfig
from .data import TrainingData
from .plan import ImageStream, Packer, Resolution, default_lookahead

__all__ = ["RunPlan", "TrainError", "build_encoder", "build_plan", "describe", "select_trainable", "steps_for_epochs"]


class TrainError(RuntimeError):
    """The run cannot go on: a non-finite loss, a tower that cannot be loaded, a budget below one image."""


def describe(config: EncoderConfig) -> str:
    """An encoder's shape in one line (compared on resume): :meth:`MoonViTConfig.describe` (or the classic ViT's)."""
    return config.describe()


def build_encoder(config: TrainConfig) -> tuple[Encoder, MoonViTImageProcessor]:
    """The encoder to train (fp32 weights, in train mode, gradient checkpointing as asked, frozen or
    wrapped in LoRA adapters as asked: :func:`select_trainable`) and the processor whose normalisation
    it expects: a MoonViT, or a classic ViT / DeiT (:mod:`moonvit_train.classic`) from one of its presets
    or folders, its table resampled to ``--image-size`` where given.

    A preset is initialised from ``--seed``; so is, with a ``--checkpoint``, whatever is drawn next
    (LoRA's A matrices, the objective's head or decoder), since the seed is set last here either way.
    """
    model = config.model
    encoder: Encoder
    try:
        if model.checkpoint is not None:
            try:
                loaded = MoonViT.from_pretrained(model.checkpoint, dtype=torch.float32)
                processor = processor_of(loaded, model.checkpoint)
            except (CheckpointError, OSError, ValueError) as error:
                raise TrainError(f"cannot load --checkpoint {model.checkpoint}: {error}") from error
            if not isinstance(loaded, (MoonViT, ClassicViT)):
                raise TrainError(
                    f"--checkpoint {model.checkpoint} holds the {tower_name(loaded.config)} "
                    f"({type(loaded).__name__}): the trainer trains one MoonViT or ViT tower (ViT, DeiT, SigLIP, "
                    "DINOv2; their folders load as one)"
                )
            if isinstance(loaded, ClassicViT):
                encoder = classic_tower(model, loaded)
                processor = follow_table(processor, loaded.config, encoder.config)  # --image-size
            else:
                _refuse_image_size(model, f"--checkpoint {model.checkpoint}")
                encoder = MoonViT(dataclasses.replace(loaded.config, drop_path_rate=model.drop_path))
                encoder.load_state_dict(loaded.state_dict())
            torch.manual_seed(config.run.seed)  # the objective's new parameters are drawn next
        else:
            assert model.preset is not None
            torch.manual_seed(config.run.seed)
            if model.preset in CLASSIC_PRESETS:
                encoder = classic_tower(model, None)
                processor = classic_processor(encoder.config, preset=model.preset)
            else:
                _refuse_image_size(model, f"--preset {model.preset}")
                encoder, processor = _moonvit_preset(config), preset_processors(model.preset).image  # its family's
        if is_classic(encoder) and config.runtime.save_layout != "own":
            raise ClassicError(
                f"--save-layout {config.runtime.save_layout} writes a MoonViT release's layout; a classic ViT is "
                "saved in its own (--save-layout own), which MoonViT.from_pretrained loads"
            )
    except ClassicError as error:
        raise TrainError(str(error)) from error
    if model.grad_checkpointing:
        encoder.gradient_checkpointing_enable()
    select_trainable(encoder, model)
    return encoder.train(), processor


def _moonvit_preset(config: TrainConfig) -> MoonViT:
    """A MoonViT preset, its shape overridden by ``--depth`` ... ``--pos-emb-size``, drawn from torch's generator."""
    model = config.model
    overrides = model.shape_overrides(init_pos_emb_height=model.pos_emb_size, init_pos_emb_width=model.pos_emb_size)
    assert model.preset is not None
    try:
        model_config = preset_config(model.preset, drop_path_rate=model.drop_path, **overrides)
    except ValueError as error:
        raise TrainError(f"--preset {model.preset} with {overrides}: {error}") from error
    return MoonViT(model_config)


def _refuse_image_size(model: ModelSection, source: str) -> None:
    if model.image_size is not None:
        raise TrainError(
            f"--image-size resamples a classic ViT's 1D position table; {source} is a MoonViT, whose 2D table "
            "is interpolated to every image's grid already (--pos-emb-size sizes a preset's)"
        )


def select_trainable(encoder: Encoder, model: ModelSection) -> None:
    """Freeze what ``--freeze`` / ``--freeze-blocks`` name, or wrap the ``--lora-targets`` linears in
    LoRA adapters (every other weight of the tower frozen), in place (a classic ViT:
    :func:`~moonvit_train.classic.select_trainable_classic`).

    A frozen weight has ``requires_grad`` False: the optimizer never holds it (so weight decay cannot
    move it), DDP leaves it out of its reduction, and autograd records nothing on it. Since the
    input pixels need no gradient either, a frozen part of the tower builds no graph and keeps no
    activations, as under ``no_grad``, up to the first block that trains (with ``--freeze tower``:
    the objective's head). Frozen blocks also lose their stochastic depth: they are a fixed feature
    extractor, which computes in training what it computes at inference.
    """
    if isinstance(encoder, ClassicViT):
        try:
            select_trainable_classic(encoder, model)
        except ClassicError as error:
            raise TrainError(str(error)) from error
        return
    blocks = encoder.encoder.blocks
    if model.lora_rank is not None:
        assert model.lora_targets is not None
        lora = LoRAConfig(model.lora_rank, model.lora_alpha, model.lora_dropout or 0.0, model.lora_targets)
        try:
            apply_lora(encoder, lora)
        except ValueError as error:
            raise TrainError(f"--lora-targets {','.join(model.lora_targets)}: {error}") from error
        return
    if model.freeze == "tower":
        encoder.requires_grad_(False)
        frozen_blocks = len(blocks)
    elif model.freeze_blocks is not None:
        frozen_blocks = model.freeze_blocks
        if frozen_blocks > len(blocks):
            raise TrainError(
                f"--freeze-blocks {frozen_blocks}: the tower has {len(blocks)} blocks "
                "(--freeze tower freezes all of it, the final norm too)"
            )
        encoder.patch_embed.requires_grad_(False)
        for block in blocks[:frozen_blocks]:
            block.requires_grad_(False)
    else:
        return
    for block in blocks[:frozen_blocks]:
        assert isinstance(block, Block)
        block.drop_path = 0.0


@dataclasses.dataclass
class RunPlan:
    """The run's plan: training sizes and packs, evaluation sizes."""

    resolution: Resolution
    eval_resolution: Resolution
    packer: Packer
    packs_per_step: int

    def eval_grids(self, source: ImageSource) -> list[tuple[int, int]]:
        return [self.eval_resolution.grid(int(w), int(h)) for w, h in source.sizes()]


def build_plan(
    config: TrainConfig, encoder: EncoderConfig, data: TrainingData, ranks: Ranks, grid_unit: int = 1
) -> RunPlan:
    """Resolution, token drop, stream and packer; refuses a budget below one image. Sizes are rounded to whole
    merge units: 2x2 patches for a MoonViT, one patch for a classic ViT, and multiples of ``grid_unit``
    (the objective's: a teacher's merge kernel)."""
    unit = math.lcm(*encoder.merge_kernel_size, grid_unit)
    common = dict(max_patches=config.data.batch_patches, patch_size=encoder.patch_size, unit=unit)
    low, high = config.data.resolution
    resolution = Resolution(low, high, max_grid_side=encoder.max_grid_side, **common)
    rows, cols = resolution.smallest_square()
    least = max(config.data.token_drop.kept(rows * cols, 0.0), config.data.token_drop.kept(rows * cols, 1.0))
    if config.data.batch_patches < least:
        raise TrainError(
            f"--batch-patches {config.data.batch_patches} is below one image: a {low} px image has "
            f"{rows}x{cols} = {rows * cols} patches ({least} kept); use a budget of a few hundred images "
            f"(e.g. --batch-patches {256 * least}) or a smaller --resolution"
        )
    packs_per_step = config.data.packs_per_step or ranks.world_size
    if packs_per_step % ranks.world_size:
        raise TrainError(
            f"--packs-per-step {packs_per_step} cannot be shared out over {ranks.world_size} ranks evenly; "
            f"use a multiple of {ranks.world_size}"
        )
    stream = ImageStream(data.train.sizes(), resolution, config.data.token_drop, config.run.seed)
    width, height = (int(n) for n in stream.sizes[0])
    rows, cols = resolution.grid(width, height, 0.5)
    typical = config.data.token_drop.kept(rows * cols, 0.5)
    packer = Packer(stream, config.data.batch_patches, default_lookahead(config.data.batch_patches, typical))
    size = config.data.eval_resolution
    eval_resolution = Resolution(size, size, max_grid_side=encoder.max_grid_side, **common)
    return RunPlan(resolution, eval_resolution, packer, packs_per_step)


def steps_for_epochs(plan: RunPlan, epochs: float, samples: int = 100) -> int:
    """Steps that show about ``epochs`` passes over the training images, from ``samples`` simulated packs
    at the schedule's mean token-drop rate."""
    probe = copy.deepcopy(plan.packer)
    drop = probe.stream.drop
    mean_rate = (drop.start + drop.end) / 2
    probe.stream.drop = dataclasses.replace(drop, start=mean_rate, end=mean_rate)
    images = sum(len(probe.next_pack(0.0)) for _ in range(samples)) / samples
    return max(1, math.ceil(epochs * len(probe.stream.sizes) / (images * plan.packs_per_step)))
