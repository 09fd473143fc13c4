"""Building a run from its config: the encoder (and the processor it expects) with what of it trains,
the plan of packs and the step count of an ``--epochs`` run."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from moonvit import CheckpointError, MoonViT, MoonViTConfig, MoonViTImageProcessor, preset_config, preset_processors
from moonvit.distributed import Ranks
from moonvit.model.blocks import Block
from moonvit.model.lora import LoRAConfig, apply_lora

from .batch import ImageSource
from .config import ModelSection, TrainConfig
from .data import TrainingData
from .plan import ImageStream, Packer, Resolution, default_lookahead

__all__ = ["RunPlan", "TrainError", "build_encoder", "build_plan", "describe", "select_trainable", "steps_for_epochs"]


class TrainError(RuntimeError):
    """The run cannot go on: a non-finite loss, a tower that cannot be loaded, a budget below one image."""


def describe(config: MoonViTConfig) -> str:
    """An encoder's shape in one line (compared on resume): :meth:`MoonViTConfig.describe`."""
    return config.describe()


def build_encoder(config: TrainConfig) -> tuple[MoonViT, MoonViTImageProcessor]:
    """The encoder to train (fp32 weights, in train mode, gradient checkpointing as asked, frozen or
    wrapped in LoRA adapters as asked: :func:`select_trainable`) and the processor whose normalisation
    it expects.

    A preset is initialised from ``--seed``; so is, with a ``--checkpoint``, whatever is drawn next
    (LoRA's A matrices, the objective's head or decoder), since the seed is set last here either way.
    """
    if config.model.checkpoint is not None:
        try:
            loaded = MoonViT.from_pretrained(config.model.checkpoint, dtype=torch.float32)
            processor = MoonViTImageProcessor.from_pretrained(config.model.checkpoint)
        except (CheckpointError, OSError, ValueError) as error:
            raise TrainError(f"cannot load --checkpoint {config.model.checkpoint}: {error}") from error
        encoder = MoonViT(dataclasses.replace(loaded.config, drop_path_rate=config.model.drop_path))
        encoder.load_state_dict(loaded.state_dict())
        torch.manual_seed(config.run.seed)  # the objective's new parameters are drawn next
    else:
        overrides = {
            field: value
            for field, value in (
                ("num_hidden_layers", config.model.depth),
                ("hidden_size", config.model.width),
                ("num_attention_heads", config.model.heads),
                ("intermediate_size", config.model.mlp_width),
                ("init_pos_emb_height", config.model.pos_emb_size),
                ("init_pos_emb_width", config.model.pos_emb_size),
            )
            if value is not None
        }
        assert config.model.preset is not None
        try:
            model_config = preset_config(config.model.preset, drop_path_rate=config.model.drop_path, **overrides)
        except ValueError as error:
            raise TrainError(f"--preset {config.model.preset} with {overrides}: {error}") from error
        torch.manual_seed(config.run.seed)
        encoder, processor = MoonViT(model_config), preset_processors(config.model.preset).image  # its family's rule
    if config.model.grad_checkpointing:
        encoder.gradient_checkpointing_enable()
    select_trainable(encoder, config.model)
    return encoder.train(), processor


def select_trainable(encoder: MoonViT, model: ModelSection) -> None:
    """Freeze what ``--freeze`` / ``--freeze-blocks`` name, or wrap the ``--lora-targets`` linears in
    LoRA adapters (every other weight of the tower frozen), in place.

    A frozen weight has ``requires_grad`` False: the optimizer never holds it (so weight decay cannot
    move it), DDP leaves it out of its reduction, and autograd records nothing on it. Since the
    input pixels need no gradient either, a frozen part of the tower builds no graph and keeps no
    activations, as under ``no_grad``, up to the first block that trains (with ``--freeze tower``:
    the objective's head). Frozen blocks also lose their stochastic depth: they are a fixed feature
    extractor, which computes in training what it computes at inference.
    """
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


def build_plan(config: TrainConfig, encoder: MoonViTConfig, data: TrainingData, ranks: Ranks) -> RunPlan:
    """Resolution, token drop, stream and packer; refuses a budget below one image."""
    unit = math.lcm(*encoder.merge_kernel_size)
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
