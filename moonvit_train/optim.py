"""AdamW with the ViT recipe's parameter groups, and the warmup + cosine learning-rate schedule.

Groups: weight decay on matrices only (none on norms, biases, LayerScale, the position table, a classic ViT's
prefix tokens and its MAP head's latent query); with ``layer_decay`` < 1 (fine-tuning a pretrained tower) each
encoder depth gets ``lr * layer_decay ** (depth + 1 - d)``: the patch embedding (and a classic ViT's table and
prefix tokens, registers included) is depth 0, block i depth i + 1 (its LayerScale with it), the final norm (and
the MAP head above it) depth ``num_layers + 1`` (full rate); the objective's own parameters (a new head), and a
classic ViT's own head(s), get ``head_lr``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from .classic import TOKEN_NAMES, Encoder, head_parameter, is_classic

__all__ = ["OptimConfig", "build_optimizer", "build_schedule", "lr_factor", "param_groups"]

NO_DECAY_NAMES = ("pos_emb.weight", "pos_embed", *TOKEN_NAMES, "attn_pool.latent")
"""Parameters besides norms, biases and LayerScales (every 1-D tensor) that are not weight-decayed: MoonViT's table,
and a classic ViT's table and prefix tokens (as timm's ``no_weight_decay``), registers included, and its MAP head's
latent query (a learned token as CLS is)."""
EMBEDDING_NAMES = ("patch_embed.", "pos_embed", *TOKEN_NAMES)
"""Names that start depth 0 (below the first block) for layer-wise decay."""


@dataclass(frozen=True)
class OptimConfig:
    """The optimisation recipe (``python -m moonvit_train``'s optimisation flags, same names).

    ``head_lr``: peak rate of the objective's own parameters (None: ``lr``, see :attr:`objective_lr`);
    ``warmup``: linear warmup share of the steps; ``min_lr_ratio``: final rate / peak rate;
    ``clip_grad``: gradient norm clip (0: off); ``ema``: decay of the moving average of the trained
    weights (:mod:`moonvit_train.ema`; None: none kept).
    """

    lr: float
    head_lr: float | None
    weight_decay: float
    layer_decay: float
    betas: tuple[float, float] = (0.9, 0.999)
    min_lr_ratio: float = 0.01
    warmup: float = 0.05
    clip_grad: float = 1.0
    ema: float | None = None

    @property
    def objective_lr(self) -> float:
        """The objective's peak rate: ``head_lr``, else ``lr``."""
        return self.lr if self.head_lr is None else self.head_lr


def encoder_depth(name: str, num_layers: int) -> int:
    """Depth of an encoder parameter for layer-wise decay: 0 embedding, i + 1 block i, num_layers + 1 final norm
    (MoonViT's ``encoder.blocks.i``, a classic ViT's ``blocks.i``)."""
    block = re.match(r"(?:encoder\.)?blocks\.(\d+)\.", name)
    if block:
        return int(block.group(1)) + 1
    return 0 if name.startswith(EMBEDDING_NAMES) else num_layers + 1


def param_groups(encoder: Encoder, objective: nn.Module, config: OptimConfig) -> list[dict]:
    """AdamW parameter groups (see the module docstring); each carries its own base ``lr``."""
    num_layers, classic = encoder.config.num_hidden_layers, is_classic(encoder)
    groups: dict[tuple[str, int], dict] = {}

    def add(param: nn.Parameter, name: str, lr: float, part: str, depth: int) -> None:
        decay = param.ndim > 1 and not name.endswith(NO_DECAY_NAMES)
        key = (f"{part}.{'decay' if decay else 'no_decay'}", depth)
        group = groups.setdefault(
            key,
            {
                "params": [],
                "lr": lr,
                "weight_decay": config.weight_decay if decay else 0.0,
                "name": f"{key[0]}.{depth}",
            },
        )
        group["params"].append(param)

    for name, param in encoder.named_parameters():
        if param.requires_grad and classic and head_parameter(name):
            add(param, name, config.objective_lr, "objective", 0)  # the classifier the objective trains
        elif param.requires_grad:
            depth = encoder_depth(name, num_layers)
            add(param, name, config.lr * config.layer_decay ** (num_layers + 1 - depth), "encoder", depth)
    for name, param in objective.named_parameters():
        if param.requires_grad:
            add(param, name, config.objective_lr, "objective", 0)
    return list(groups.values())


def build_optimizer(groups: list[dict], config: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, fused where this torch has a fused kernel for the device (several times faster on CPU)."""
    try:
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, fused=True)
    except (RuntimeError, TypeError):  # no fused kernel here (device, dtype or parameter type)
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, foreach=device.type == "cuda")


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Learning-rate multiplier at ``step``: linear warmup from ~0 over ``warmup`` steps, then a half
    cosine from 1 down to ``min_ratio`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(total - 1 - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_schedule(
    optimizer: torch.optim.Optimizer, total: int, warmup: int, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-step schedule of every group (each keeps its own base lr)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup, min_ratio))
