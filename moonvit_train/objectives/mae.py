"""Masked autoencoding (MAE) on packed native-resolution images.

Per image, ``round(mask_ratio * patches)`` patches are masked, at random (the plan draws them
from each image's seed, as it does for token dropping); the encoder runs on the visible patches
only, packed with the other images' visible patches, each keeping the position-table row and
RoPE angles of its place in the full grid, so the saving in encoder compute is real.

A light decoder then sees every patch of every image: the encoded visible patches, projected to
its width, and a shared learnable mask token at each masked position, plus fixed 2D sin-cos
position embeddings of (row, col). Its blocks are the encoder's own block (attention within each
image, 2D RoPE). Both position signals on purpose: the mask tokens are all alike, so each needs
its absolute place to know which patch to paint (MAE's sin-cos), and RoPE comes with the block,
keeping attention relative as in the encoder.

Loss: the mean squared error of each masked patch's prediction (its 3 * 14 * 14 normalised
pixels), against the patch normalised by its own mean and variance (MAE's ``norm_pix_loss``) or
as it is. The loss is a sum over masked patches; the engine divides it by the step's masked
patches over all ranks (known from the plan), so it is the exact token-weighted mean.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.nn as nn

from moonvit import MoonViT, MoonViTConfig, PackedGrid, build_packed_grid
from moonvit.cli import fraction, positive_int
from moonvit.files import save_safetensors_atomic
from moonvit.model.attention import bind_attention, resolve_attn_implementation
from moonvit.model.blocks import Block, make_norm

from ..batch import Batch, kept_rows
from ..classic import Encoder
from ..plan import PlannedTrainImage, TokenDrop
from .base import Objective, ObjectiveOutput

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["DECODER_FILE", "MAEObjective", "sincos_2d"]

DECODER_FILE = "mae_decoder.safetensors"
EVAL_MASK_SEED = 0


def sincos_2d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(L, dim) float32 fixed embedding of (row, col): half the channels for each axis, each half
    ``[sin(p w) | cos(p w)]`` with ``w_i = 10000 ** (-i / (dim / 4))`` (MAE's 2D sin-cos)."""
    quarter = dim // 4
    omega = 10000.0 ** (-torch.arange(quarter, dtype=torch.float64, device=positions.device) / quarter)
    parts = []
    for axis in (0, 1):
        angles = positions[:, axis : axis + 1].double() * omega
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1).float()


def patch_targets(pixels: torch.Tensor, normalize: bool) -> torch.Tensor:
    """(L, 3, p, p) -> (L, 3 p p) float32 targets, each patch normalised by its own mean and variance."""
    flat = pixels.flatten(1).to(torch.promote_types(pixels.dtype, torch.float32))
    if not normalize:
        return flat
    mean, var = flat.mean(dim=1, keepdim=True), flat.var(dim=1, keepdim=True)
    return (flat - mean) / (var + 1e-6).sqrt()


def random_keep(grid_thws: torch.Tensor, ratio: float, generator: torch.Generator) -> list[torch.Tensor]:
    """Per item, sorted indices of ``patches - round(ratio * patches)`` patches kept at random (at least one)."""
    keep = []
    for patches in grid_thws.prod(dim=1).tolist():
        kept = max(1, patches - round(ratio * patches))
        keep.append(torch.randperm(patches, generator=generator)[:kept].sort().values)
    return keep


class MAEObjective(Objective):
    """MAE's reconstruction of masked patches (see the module docstring)."""

    name = "mae"
    needs_full_pixels = True
    draws_pictures = True
    needs_labels = False
    # MAE's recipe (He et al., 2022): AdamW (0.9, 0.95), no stochastic depth in pretraining.
    default_betas = (0.9, 0.95)
    default_drop_path = 0.0

    def __init__(
        self,
        encoder_config: MoonViTConfig,
        mask_ratio: float = 0.75,
        width: int = 128,
        depth: int = 2,
        heads: int = 4,
        norm_pix: bool = True,
    ) -> None:
        super().__init__()
        self.mask_ratio = mask_ratio
        self.norm_pix = norm_pix
        p = encoder_config.patch_size
        self.decoder_config = MoonViTConfig(
            patch_size=p,
            num_attention_heads=heads,
            num_hidden_layers=depth,
            hidden_size=width,
            intermediate_size=4 * width,
            merge_kernel_size=encoder_config.merge_kernel_size,
            rope_theta=encoder_config.rope_theta,
            max_grid_side=encoder_config.max_grid_side,
            init_pos_emb_time=encoder_config.init_pos_emb_time,
            # the encoder's family: its norm and bias switches (K3: RMSNorm, no biases)
            layer_norm_eps=encoder_config.layer_norm_eps,
            norm_type=encoder_config.norm_type,
            attn_bias=encoder_config.attn_bias,
            linear_bias=encoder_config.linear_bias,
        )
        self.embed = nn.Linear(encoder_config.hidden_size, width)
        self.mask_token = nn.Parameter(torch.zeros(width))
        self.blocks = nn.ModuleList(Block.from_config(self.decoder_config) for _ in range(depth))
        self.norm = make_norm(width, encoder_config.norm_type, encoder_config.layer_norm_eps)
        self.predict = nn.Linear(width, encoder_config.num_channels * p * p)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.mask_token, std=0.02)

    # ---- command line -------------------------------------------------------------------------

    @dataclass(frozen=True)
    class Options:
        mask_ratio: float = 0.75
        decoder_width: int = 128
        decoder_depth: int = 2
        decoder_heads: int = 4
        norm_pix: bool = True

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--mask-ratio", type=fraction, default=0.75, help="share of each image's patches masked (default: 0.75)"
        )
        parser.add_argument("--decoder-width", type=positive_int, default=128, help="MAE decoder width (default: 128)")
        parser.add_argument("--decoder-depth", type=positive_int, default=2, help="MAE decoder blocks (default: 2)")
        parser.add_argument(
            "--decoder-heads", type=positive_int, default=4, help="MAE decoder attention heads (default: 4)"
        )
        parser.add_argument(
            "--no-norm-pix", dest="norm_pix", action="store_false",
            help="reconstruct the pixels as they are, not each patch normalised by its mean and variance",
        )  # fmt: skip

    @classmethod
    def check_config(cls, config: TrainConfig, error: Callable[[str], NoReturn]) -> TrainConfig:
        options: MAEObjective.Options = config.options
        if config.data.token_drop.active:
            error("--objective mae masks with --mask-ratio; --token-drop is for the supervised objective")
        if config.augment.mixing:
            error("--objective mae reconstructs each image's own pixels: --mixup / --cutmix do not apply")
        if options.decoder_width % options.decoder_heads or (options.decoder_width // options.decoder_heads) % 4:
            error("--decoder-width / --decoder-heads must be a multiple of 4 (2D RoPE)")
        # The plan's token drop is MAE's mask: drawn per image from its seed, counted by the budget.
        return config.replace(
            data=dataclasses.replace(config.data, token_drop=TokenDrop(options.mask_ratio, options.mask_ratio))
        )

    @classmethod
    def from_config(cls, encoder: Encoder, classes: Sequence[str], config: TrainConfig) -> MAEObjective:
        """Refuses a classic ViT (the decoder is a MoonViT's blocks, with its RoPE)."""
        if not isinstance(encoder, MoonViT):
            from ..build import TrainError

            raise TrainError(
                "--objective mae pretrains a MoonViT (its decoder is MoonViT's blocks, with 2D RoPE); a classic ViT "
                "/ DeiT trains with --objective supervised, deit or distill"
            )
        o: MAEObjective.Options = config.options
        return cls(encoder.config, o.mask_ratio, o.decoder_width, o.decoder_depth, o.decoder_heads, o.norm_pix)

    # ---- the objective ------------------------------------------------------------------------

    def weight(self, items: Sequence[PlannedTrainImage]) -> int:
        return sum(item.patches - item.kept for item in items)

    def reconstruct(
        self, encoder: nn.Module, pixel_values: torch.Tensor, grid: PackedGrid, keep: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, PackedGrid]:
        """Encode the visible patches, decode every patch.

        Returns:
            (L_full, 3 p p) predictions (float32, or float64 for a float64 model), (L_full,) bool
            mask of the masked patches, and the decoder's grid of the full images.
        """
        encoded = encoder(pixel_values, grid=grid).last_hidden_state  # (K, D)
        full = build_packed_grid(grid.grid_thws, self.decoder_config, encoded.device)
        visible = kept_rows(full.grid_thws, keep)
        masked = torch.ones(full.num_patches, dtype=torch.bool, device=encoded.device)
        masked[visible] = False
        tokens = self.embed(encoded)
        x = self.mask_token.to(tokens.dtype).expand(full.num_patches, -1).index_copy(0, visible, tokens)
        x = x + sincos_2d(full.positions, x.shape[1]).to(x.dtype)
        attend = bind_attention(resolve_attn_implementation("auto", x.device, x.dtype), full)
        for block in self.blocks:
            x = block(x, full.rope_rotation, attend, full)
        prediction = self.predict(self.norm(x))
        return prediction.to(torch.promote_types(prediction.dtype, torch.float32)), masked, full

    def loss_sum(self, prediction: torch.Tensor, masked: torch.Tensor, full_pixels: torch.Tensor) -> torch.Tensor:
        """Sum over masked patches of each one's mean squared error."""
        errors = (prediction - patch_targets(full_pixels, self.norm_pix)).square().mean(dim=1)
        return errors[masked].sum()

    def forward(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        if batch.full_pixels is None or batch.keep is None:
            raise ValueError("MAE batches need every patch and the kept indices (a mask ratio above 0)")
        prediction, masked, _ = self.reconstruct(encoder, batch.pixel_values, batch.grid, batch.keep)
        return ObjectiveOutput(self.loss_sum(prediction, masked, batch.full_pixels))

    def masked_eval_inputs(
        self, encoder: nn.Module, batch: Batch
    ) -> tuple[torch.Tensor, PackedGrid, list[torch.Tensor]]:
        """An evaluation batch (every patch) masked with a fixed generator: the same masks on every run."""
        generator = torch.Generator().manual_seed(EVAL_MASK_SEED)
        thws = batch.grid.grid_thws.cpu()
        keep = random_keep(thws, self.mask_ratio, generator)
        rows = kept_rows(thws, keep).to(batch.pixel_values.device)
        config = encoder.config
        assert isinstance(config, MoonViTConfig)
        grid = build_packed_grid(thws, config, batch.pixel_values.device, keep=keep)
        return batch.pixel_values.index_select(0, rows), grid, [k.to(rows.device) for k in keep]

    @torch.no_grad()
    def evaluate(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        """Per image, the mean error over its masked patches; the loss sum adds those per-image means."""
        pixels, grid, keep = self.masked_eval_inputs(encoder, batch)
        prediction, masked, full = self.reconstruct(encoder, pixels, grid, keep)
        errors = (prediction - patch_targets(batch.pixel_values, self.norm_pix)).square().mean(dim=1)
        errors = torch.where(masked, errors, torch.zeros_like(errors))
        owner = full.item_index
        per_image = errors.new_zeros(full.num_images).index_add_(0, owner, errors)
        counts = masked.float().new_zeros(full.num_images).index_add_(0, owner, masked.float())
        per_image = per_image / counts
        return ObjectiveOutput(per_image.sum(), {}, per_image.unsqueeze(1))

    def report(self, outputs: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]) -> dict[str, Any]:
        per_image = outputs[:, 0].double()
        return {
            "reconstruction_mse": float(per_image.mean()),
            "target": "each patch normalised by its mean and variance" if self.norm_pix else "pixels",
            "mask_ratio": self.mask_ratio,
            "images": len(per_image),
        }

    # ---- pictures and files -------------------------------------------------------------------

    @torch.no_grad()
    def visualize(self, encoder: nn.Module, batch: Batch, processor: Any, path: Path) -> bool:
        """A PNG grid: per image, the original, the visible patches (masked ones grey) and the
        reconstruction (visible patches as they are, masked ones predicted; with normalised targets,
        each prediction is brought back to its patch's own mean and spread, as MAE draws them)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        pixels, grid, keep = self.masked_eval_inputs(encoder, batch)
        prediction, masked, full = self.reconstruct(encoder, pixels, grid, keep)
        target = batch.pixel_values.flatten(1).float()
        if self.norm_pix:
            mean, var = target.mean(dim=1, keepdim=True), target.var(dim=1, keepdim=True)
            prediction = prediction * (var + 1e-6).sqrt() + mean
        painted = torch.where(masked.unsqueeze(1), prediction, target).view_as(batch.pixel_values)
        grey = torch.zeros_like(batch.pixel_values)  # 0 after normalisation: mid grey
        visible = torch.where(masked.view(-1, 1, 1, 1), grey, batch.pixel_values)
        thws = full.grid_thws.cpu()
        columns = [batch.pixel_values, visible, painted]
        images = [processor.to_images(c.cpu(), thws[:, 1:]) for c in columns]
        count = len(thws)
        figure, axes = plt.subplots(count, 3, figsize=(6, 2 * count), squeeze=False)
        for row in range(count):
            for col, title in enumerate(("original", f"masked {self.mask_ratio:.0%}", "reconstruction")):
                axes[row, col].imshow(images[col][row].permute(1, 2, 0).numpy())
                axes[row, col].set_axis_off()
                if row == 0:
                    axes[row, col].set_title(title, fontsize=9)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return True

    def save(self, out: Path, state: dict[str, torch.Tensor]) -> list[str]:
        """``mae_decoder.safetensors``: the decoder, to continue pretraining or look at reconstructions."""
        about = {"mask_ratio": str(self.mask_ratio), "norm_pix": str(self.norm_pix),
                 "decoder": json_config(self.decoder_config)}  # fmt: skip
        save_safetensors_atomic(state, out / DECODER_FILE, about)
        return [DECODER_FILE]


def json_config(config: MoonViTConfig) -> str:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size")
    return json.dumps({key: getattr(config, key) for key in keys})
