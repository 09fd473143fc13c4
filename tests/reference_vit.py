"""A plain, per-image, unpacked ViT / DeiT as timm's ``VisionTransformer`` runs it with ``dynamic_img_size``.

Written from timm's description, for the parity tests of the classic-ViT tower (timm is not a
dependency of this package):

- the patch embedding is a Conv2d (kernel = stride = patch) over the whole image;
- the prefix tokens (``cls_token``, then DeiT's ``dist_token``) are concatenated before the patches
  and ``pos_embed`` (prefix rows first, then the square table) is added to the whole sequence;
- the table's patch rows are resampled to the image's grid by :func:`resample_abs_pos_embed` (timm's
  ``timm.layers.resample_abs_pos_embed``: bicubic, ``antialias=True``, ``align_corners=False``, in
  float32, skipped only when the token count matches and the new grid is square);
- pre-LN blocks: ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``, plain softmax attention over the
  fused ``qkv`` projection, exact (erf) GELU, LayerNorm eps 1e-6;
- the head reads the CLS row after the final norm; a distilled model's logits are
  ``(head(x[:, 0]) + head_dist(x[:, 1])) / 2`` (timm's inference path).

Tensor names equal timm's state-dict names, so :func:`save_timm_folder` writes a folder as timm's
hub checkpoints store it (``config.json`` with ``architecture``, ``model.safetensors``).
:func:`timm_eval_transform` is timm's evaluation transform of an image (the processors' reference).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

LAYER_NORM_EPS = 1e-6


def resample_abs_pos_embed(
    posemb: torch.Tensor,
    new_size: tuple[int, int],
    old_size: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """timm's table resampling: (1, prefix + old_h * old_w, D) -> (1, prefix + new_h * new_w, D).

    The prefix rows pass through unchanged; the patch rows are resampled bicubically with
    antialias (PIL's cubic kernel, a = -0.5) in ``compute_dtype`` (timm: float32, whatever the
    table's dtype) and cast back. Nothing changes when the token count matches and the new grid is
    square. ``compute_dtype`` float64 gives the same rule without timm's float32 rounding.
    """
    num_pos_tokens = posemb.shape[1]
    num_new_tokens = new_size[0] * new_size[1] + num_prefix_tokens
    if num_new_tokens == num_pos_tokens and new_size[0] == new_size[1]:
        return posemb
    if old_size is None:
        side = int(math.sqrt(num_pos_tokens - num_prefix_tokens))
        old_size = (side, side)
    prefix, patches = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim, dtype = patches.shape[-1], patches.dtype
    grid = patches.to(compute_dtype).reshape(1, old_size[0], old_size[1], dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_size, mode="bicubic", antialias=True)
    patches = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(dtype)
    return torch.cat([prefix, patches], dim=1)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, in_chans: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """(1, C, H, W) -> (1, H/p, W/p, D)."""
        return self.proj(image).permute(0, 2, 3, 1)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T, D) -> (1, T, D): softmax(q k^T / sqrt(head_dim)) v per head."""
        batch, count, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, count, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        weights = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(batch, count, dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, qkv_bias: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attn = Attention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.mlp = Mlp(dim, mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmViT(nn.Module):
    """timm's ``VisionTransformer`` (``distilled``: ``VisionTransformerDistilled``), token pooling,
    ``dynamic_img_size=True``, run one image at a time."""

    def __init__(
        self,
        *,
        img_size: int,
        patch_size: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        num_classes: int = 0,
        distilled: bool = False,
        qkv_bias: bool = True,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_prefix_tokens = 2 if distilled else 1
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        patches = self.grid_size[0] * self.grid_size[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + self.num_prefix_tokens, embed_dim))
        hidden = int(embed_dim * mlp_ratio)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, hidden, qkv_bias) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=LAYER_NORM_EPS)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes else None
        self.head_dist = nn.Linear(embed_dim, num_classes) if num_classes and distilled else None

    def forward_features(self, image: torch.Tensor, table_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(C, H, W) -> (prefix + H/p * W/p, D), the token rows after the final norm."""
        x = self.patch_embed(image.unsqueeze(0))
        _, rows, cols, dim = x.shape
        pos_embed = resample_abs_pos_embed(
            self.pos_embed, (rows, cols), self.grid_size, self.num_prefix_tokens, compute_dtype=table_dtype
        )
        prefix = [t.expand(1, -1, -1) for t in (self.cls_token, self.dist_token) if t is not None]
        x = torch.cat([*prefix, x.reshape(1, rows * cols, dim)], dim=1) + pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)[0]

    def forward(self, image: torch.Tensor, table_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """One (C, H, W) image: ``tokens`` (T, D) after the final norm (prefix rows first), ``pooled``
        (D,) the CLS row, and with a head ``logits`` (classes,) (distilled: also ``head_logits``
        (2, classes), the CLS head's then the distillation head's)."""
        tokens = self.forward_features(image, table_dtype)
        out = {"tokens": tokens, "pooled": tokens[0]}
        if self.head is not None:
            if self.head_dist is not None:
                out["head_logits"] = torch.stack([self.head(tokens[0]), self.head_dist(tokens[1])])
                out["logits"] = (out["head_logits"][0] + out["head_logits"][1]) / 2
            else:
                out["logits"] = self.head(tokens[0])
        return out


def save_timm_folder(
    folder: Path,
    model: TimmViT,
    architecture: str,
    *,
    num_classes: int,
    input_size: int,
    model_args: dict[str, Any] | None = None,
    **extra: Any,
) -> Path:
    """Write ``model`` as a timm hub folder: ``config.json`` (``architecture``, ``num_classes``,
    ``pretrained_cfg.input_size`` (channels, side, side), optional ``model_args`` and any ``extra`` keys) and
    ``model.safetensors`` in timm's tensor names."""
    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "architecture": architecture,
        "num_classes": num_classes,
        "num_features": model.norm.normalized_shape[0],
        "pretrained_cfg": {
            "input_size": [model.patch_embed.proj.in_channels, input_size, input_size],
            "interpolation": "bicubic",
        },
        **extra,
    }
    if model_args is not None:
        config["model_args"] = model_args
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


# ---- timm's evaluation transform -------------------------------------------------------------------


def timm_eval_transform(
    image: Image.Image, size: int, crop_pct: float, resample: int, mean: Any, std: Any
) -> torch.Tensor:
    """timm's evaluation transform, from its description: torchvision's ``Resize(floor(size / crop_pct))``
    (the shorter side to that, the longer to ``int(s * long / short)``, Pillow), ``CenterCrop(size)``
    (offsets ``int(round((side - size) / 2.0))``), ``ToTensor`` (float32 ``x / 255``), ``Normalize``:
    (3, size, size) float32."""
    scaled = math.floor(size / crop_pct)
    width, height = image.size
    if width <= height:
        new = (scaled, int(scaled * height / width))
    else:
        new = (int(scaled * width / height), scaled)
    resized = image.resize(new, resample)
    left, top = round((new[0] - size) / 2.0), round((new[1] - size) / 2.0)
    crop = resized.crop((left, top, left + size, top + size))
    x = torch.from_numpy(np.array(crop)).permute(2, 0, 1).to(torch.float32).div(255)
    return (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
