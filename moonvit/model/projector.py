"""The projector from MoonViT's merged patches to a language model's embedding space.

Four architectures, chosen by :attr:`ProjectorConfig.projector_type`:

- ``"kimi"``: Kimi-VL's and Kimi-K2.5's projector. LayerNorm over the D features
  of each patch (before the patches of a group are joined), then the kh * kw
  patches of a group concatenated to kh * kw * D, Linear(4D -> 4D), exact (erf)
  GELU, Linear(4D -> text_hidden_size).
- ``"patchmergerv2"``: Kimi K3's. No pre-norm: the kh * kw patches of a group
  concatenated to 4D, Linear(4D -> 4D), exact GELU, Linear(4D -> text_hidden_size),
  both without biases, then RMSNorm(text_hidden_size, eps) after them.
- ``"mlp1"``: NVIDIA LocateAnything-3B's (InternVL's ``mlp1``). The kh * kw patches of a
  group concatenated to 4D first, LayerNorm over that whole 4D vector, Linear(4D ->
  text_hidden_size), exact GELU, Linear(text_hidden_size -> text_hidden_size).
- ``"mlp2x_gelu"``: LLaVA-1.5's projector, for training from scratch. No norm;
  Linear(4D -> text_hidden_size), exact GELU, Linear(text_hidden_size ->
  text_hidden_size) on each flattened merged token.

Checkpoints are read (by :mod:`moonvit.weights.projector`, imported when
:meth:`MoonViTProjector.from_pretrained` is called, as the encoder's loader is) from a
local folder or a hub id (only the files holding the projector fetched, see
:mod:`moonvit.weights.hub`) in one of these layouts:

- this project's own: ``projector_config.json`` + ``projector.safetensors``
  (tensor names ``pre_norm.*``, ``linear_1.*``, ``linear_2.*``). The names do
  not clash with the encoder's ``config.json`` / ``model.safetensors`` or the
  processor's ``preprocessor_config.json``, so one folder holds all three.
- Kimi-VL's: ``config.json`` with ``vision_config`` / ``text_config``, tensors
  ``multi_modal_projector.{pre_norm,linear_1,linear_2}.*``.
- Kimi-K2.5's: the same config sections, tensors
  ``mm_projector.{pre_norm,proj.0,proj.2}.*``.
- Kimi K3's: ``mm_projector_type "patchmergerv2"`` in ``vision_config``, tensors
  ``mm_projector.{proj.0,proj.2,post_norm}.weight``.
- LocateAnything-3B's: ``model_type "locateanything"``, tensors ``mlp1.{0,1,3}.*``
  (``mlp1.2`` is the GELU). Its transformers-native layout in review upstream
  (``model.multi_modal_projector.*``) is refused by name.

Kimi checkpoints are usually sharded beside a large language model
(``model.safetensors.index.json``); only the shards that hold projector tensors
are opened, and only those tensors are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..files import save_safetensors_atomic, write_text_atomic
from .blocks import RMSNorm
from .config import DictConfig, MoonViTConfig, merge_kernel
from .linear import linear

PROJECTOR_TYPES = ("kimi", "patchmergerv2", "mlp1", "mlp2x_gelu")
CONFIG_FILE = "projector_config.json"
WEIGHTS_FILE = "projector.safetensors"


# ---- configuration ------------------------------------------------------------------


@dataclass
class ProjectorConfig(DictConfig):
    """Hyper-parameters of a :class:`MoonViTProjector`.

    The defaults are Kimi-VL-A3B's projector (MoonViT-SO-400M into a 2048-wide LLM).

    Attributes:
        projector_type: ``"kimi"``, ``"patchmergerv2"``, ``"mlp1"`` or ``"mlp2x_gelu"`` (see the module docstring).
        vision_hidden_size: D, the encoder's per-patch width.
        text_hidden_size: the language model's embedding width (the output width).
        merge_kernel_size: (kh, kw), patches per merged token along rows and columns.
        layer_norm_eps: epsilon of the ``"kimi"`` and ``"mlp1"`` pre-norms, or of the ``"patchmergerv2"`` post-norm.
    """

    projector_type: str = "kimi"
    vision_hidden_size: int = 1152
    text_hidden_size: int = 2048
    merge_kernel_size: tuple[int, int] = (2, 2)
    layer_norm_eps: float = 1e-5
    model_type: str = field(default="moonvit_projector", init=False)

    def __post_init__(self) -> None:
        self.merge_kernel_size = merge_kernel(self.merge_kernel_size)
        if self.projector_type not in PROJECTOR_TYPES:
            raise ValueError(f"projector_type must be one of {PROJECTOR_TYPES}, got {self.projector_type!r}")
        for name in ("vision_hidden_size", "text_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def patches_per_token(self) -> int:
        """kh * kw, the patches joined into one merged token."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def merged_hidden_size(self) -> int:
        """kh * kw * D, the width of a flattened merged token."""
        return self.patches_per_token * self.vision_hidden_size

    @property
    def intermediate_size(self) -> int:
        """Width between the two linears: 4D for the Kimi projectors, text_hidden_size for ``"mlp1"`` and
        ``"mlp2x_gelu"``."""
        return self.text_hidden_size if self.projector_type in ("mlp1", "mlp2x_gelu") else self.merged_hidden_size

    @property
    def pre_norm_size(self) -> int | None:
        """The pre-norm's width: D (``"kimi"``: each patch), 4D (``"mlp1"``: each merged token), or None."""
        return {"kimi": self.vision_hidden_size, "mlp1": self.merged_hidden_size}.get(self.projector_type)

    @property
    def bias(self) -> bool:
        """Whether the linears have biases (Kimi K3's have none)."""
        return self.projector_type != "patchmergerv2"

    @classmethod
    def for_encoder(cls, encoder_config: MoonViTConfig, text_hidden_size: int, **overrides: Any) -> ProjectorConfig:
        """The config that fits ``encoder_config``'s width and merge kernel, for a new projector."""
        return cls(
            vision_hidden_size=encoder_config.hidden_size,
            merge_kernel_size=encoder_config.merge_kernel_size,
            text_hidden_size=text_hidden_size,
            **overrides,
        )


# ---- the module -----------------------------------------------------------------------


class MoonViTProjector(nn.Module):
    """Maps MoonViT's merged patch groups to language-model tokens.

    Call it on the encoder's ``out.merged`` (N, kh * kw, D) to get (N, text_hidden_size),
    one LLM token per merged token, images in the encoder's packing order.
    """

    def __init__(self, config: ProjectorConfig) -> None:
        super().__init__()
        self.config = config
        norm, v2 = config.pre_norm_size, config.projector_type == "patchmergerv2"
        self.pre_norm = None if norm is None else nn.LayerNorm(norm, eps=config.layer_norm_eps)
        self.linear_1 = nn.Linear(config.merged_hidden_size, config.intermediate_size, bias=config.bias)
        self.linear_2 = nn.Linear(config.intermediate_size, config.text_hidden_size, bias=config.bias)
        self.post_norm = RMSNorm(config.text_hidden_size, eps=config.layer_norm_eps) if v2 else None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> MoonViTProjector:
        """Load from a local folder or hub id: this project's format, a Kimi-VL, Kimi-K2.5, Kimi K3 or
        LocateAnything-3B checkpoint.

        ``projector_config.json``, where present, is read in preference to a
        Kimi ``config.json``. Only the projector's tensors are read; ``dtype``
        defaults to the checkpoint's. The model is returned in eval mode.

        Raises:
            CheckpointError: no such folder (or a file), no config or projector tensors, an
                unsupported projector, a corrupt file, or tensors that are missing,
                unexpected or of the wrong shape (all of them named).
            ValueError: a ``device`` this torch cannot reach.
        """
        from ..weights.projector import load_projector  # weights sit above the model, as for the encoder

        return load_projector(cls, path, dtype, device)

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``projector_config.json`` and ``projector.safetensors`` to the folder ``path``.

        The folder may also hold the encoder's and the processor's files.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / CONFIG_FILE, json.dumps(self.config.to_dict(), indent=2) + "\n")
        state = {name: tensor.detach().cpu() for name, tensor in self.state_dict().items()}
        save_safetensors_atomic(state, folder / WEIGHTS_FILE)

    @property
    def dtype(self) -> torch.dtype:
        return self.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.linear_1.weight.device

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """Project merged patch groups to language-model tokens.

        Args:
            merged: (..., kh * kw, D) floating, e.g. the encoder's ``out.merged``
                (L / 4, 4, D); cast to the projector's dtype.

        Returns:
            (..., text_hidden_size) in the projector's dtype.
        """
        self._check_input(merged)
        x = merged.to(self.dtype)
        per_patch = self.config.projector_type == "kimi"  # Kimi normalises each patch, mlp1 the joined token
        if self.pre_norm is not None and per_patch:
            x = self.pre_norm(x)
        x = x.flatten(-2)
        if self.pre_norm is not None and not per_patch:
            x = self.pre_norm(x)
        rows = x.reshape(-1, x.shape[-1])  # (tokens, kh * kw * D)
        # moonvit's CPU linear: bf16 widened to float32 where the CPU has no bf16 arithmetic
        x = linear(self.linear_2, F.gelu(linear(self.linear_1, rows))).reshape(*x.shape[:-1], -1)
        return x if self.post_norm is None else self.post_norm(x)

    def _check_input(self, merged: torch.Tensor) -> None:
        expected = (self.config.patches_per_token, self.config.vision_hidden_size)
        if not isinstance(merged, torch.Tensor):
            raise TypeError(f"the projector's input must be a tensor, got {type(merged).__name__}")
        if not merged.dtype.is_floating_point:
            raise TypeError(f"the projector's input must be floating, got {merged.dtype}")
        if merged.ndim < 2 or tuple(merged.shape[-2:]) != expected:
            raise ValueError(
                f"the projector expects merged patch groups of shape (..., {expected[0]}, {expected[1]}) "
                f"(the encoder's out.merged), got {tuple(merged.shape)}"
            )
        if merged.device != self.device:
            raise ValueError(f"the projector's input is on {merged.device}, the projector on {self.device}")
