"""What the rest of the package needs from an encoder, as structural types.

``moonvit_eval/``, ``moonvit_projector/export/`` and :mod:`moonvit.encode` are typed against
:class:`VisionEncoder` and its :class:`EncoderConfig`, not a concrete tower, so every tower
family serves them: :class:`~moonvit.model.encoder.MoonViT` (Kimi-VL, K2.5 / K2.6, K3,
LocateAnything) and the classic ViT / DeiT (:class:`~moonvit.families.vit.ClassicViT`), as well
as a wrapped or compiled encoder that has these members.

What differs between the families is read through the config and the output, never the class:

- ``config.merge_kernel_size``: (2, 2) for MoonViT (``merged`` is (S / 4, 4, D)), (1, 1) for the
  classic ViT (``merged`` is (L, 1, D): each patch one token);
- :func:`tower_projection`: the projector to LLM tokens a tower carries itself (OpenVLA's fused
  backbone holds Prismatic's; MoonViT's is a module of its own, a ViT tower has none);
- :func:`prefix_token_count`: the prefix tokens each item carries (0 for MoonViT and a SigLIP-like
  tower, 1 for a ViT's CLS token, 2 for DeiT's CLS and distillation tokens, 1 + R for DINOv2's CLS
  and R registers), named by :func:`prefix_token_names`; the ViT tower fills the output's
  ``prefix_tokens`` (N, n_prefix, D) and ``pooled`` (N, D) (what it is: :func:`pooled_kind`), and
  ``logits`` (N, classes) where it has a head.

What a message calls a tower (:func:`tower_name`) is its family's (:func:`moonvit.families.family_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .grid import GridGeometry, GridInput, PackedGrid

if TYPE_CHECKING:
    from .encoder import MoonViTOutput

__all__ = [
    "EncoderConfig",
    "VisionEncoder",
    "gives_hidden_states",
    "has_class_token",
    "pooled_kind",
    "prefix_token_count",
    "prefix_token_names",
    "tower_name",
    "tower_projection",
]


class EncoderConfig(GridGeometry, Protocol):
    """What the commands read of a tower's config (:class:`~moonvit.model.config.MoonViTConfig` or
    :class:`~moonvit.families.vit.config.ClassicViTConfig`), besides the grid's geometry.

    Members:
        patch_size, num_channels, merge_kernel_size, max_frames, ...: the grid's (see :class:`GridGeometry`).
        hidden_size: D, the width of every output row.
        num_hidden_layers: the blocks (``hidden_state_indices`` counts 0 .. num_hidden_layers).
        tokens_per_merge: kh * kw, the patches of one merged token (4 for MoonViT, 1 for the classic ViT).
        attn_implementation: the attention backend asked for (``auto`` or a registered name).
        model_type: the config's ``model_type`` (``classic_vit`` for the ViT tower); the programs ask
            the tower's family (:func:`moonvit.families.family_of`), not this, what differs.
        to_dict(): the config as ``config.json`` holds it (what run records and cache keys hash).
    """

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def tokens_per_merge(self) -> int: ...
    @property
    def attn_implementation(self) -> str: ...
    @property
    def model_type(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class VisionEncoder(Protocol):
    """A packed native-resolution encoder.

    Members:
        config: its :class:`EncoderConfig` (patch size, merge kernel, width and depth).
        dtype, device: where its weights live.
        prepare_grid(grid_thws): the pack's metadata (see :class:`PackedGrid`).
        __call__(pixel_values, grid_thws=None, *, grid=None, output_hidden_states=False,
            hidden_state_indices=None): a :class:`MoonViTOutput` with ``last_hidden_state``
            (L, D), the patch rows aligned with ``pixel_values`` (L, C, p, p), and ``merged``
            (L / (kh * kw), kh * kw, D); towers with prefix tokens (see :func:`prefix_token_count`)
            also give ``prefix_tokens`` (N, n_prefix, D), ``pooled`` (N, D) and, with a head,
            ``logits`` (N, classes); MoonViT leaves those None.
    """

    @property
    def config(self) -> EncoderConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def prepare_grid(self, grid_thws: GridInput, keep: Sequence[torch.Tensor] | None = None) -> PackedGrid: ...

    def __call__(
        self,
        pixel_values: torch.Tensor,
        grid_thws: GridInput | None = None,
        *,
        grid: PackedGrid | None = None,
        output_hidden_states: bool = False,
        hidden_state_indices: Sequence[int] | None = None,
    ) -> MoonViTOutput: ...


def prefix_token_count(config: EncoderConfig) -> int:
    """The prefix tokens each item of a pack carries ahead of its patches: 0 for MoonViT, the classic
    ViT's CLS token (1), DeiT's CLS and distillation tokens (2), DINOv2's CLS and registers (1 + R);
    a GAP or SigLIP-like ViT has none."""
    return int(getattr(config, "num_prefix_tokens", 0))


def prefix_token_names(config: EncoderConfig) -> tuple[str, ...]:
    """What each of an item's prefix rows is, in the tower's order: ``cls``, then DeiT's
    ``distillation`` or DINOv2's ``register_0`` .. ``register_{R-1}``; () for a tower without them
    (``prefix_0``, ... for a config that does not say which they are)."""
    count = prefix_token_count(config)
    names = ["cls"] * bool(getattr(config, "class_token", False))
    names += ["distillation"] * bool(getattr(config, "distillation_token", False))
    names += [f"register_{i}" for i in range(int(getattr(config, "num_register_tokens", 0)))]
    return tuple(names) if len(names) == count else tuple(f"prefix_{i}" for i in range(count))


def has_class_token(config: EncoderConfig) -> bool:
    """Whether the tower has a CLS token (``prefix_tokens[:, 0]`` of its outputs)."""
    return bool(getattr(config, "class_token", False)) and prefix_token_count(config) > 0


POOLED_KINDS = {"token": "cls", "avg": "mean", "map": "map"}
"""The ViT tower's ``pool`` setting -> what its ``pooled`` output is (:func:`pooled_kind`)."""


def pooled_kind(config: EncoderConfig) -> str | None:
    """What the tower's ``pooled`` (N, D) output is: ``cls`` (the CLS row after the final norm: ViT,
    DeiT, DINOv2), ``mean`` (the mean of the patch rows after it: a GAP ViT) or ``map`` (the MAP head
    over them: SigLIP); None for a tower that gives none (MoonViT)."""
    pool = getattr(config, "pool", None)
    return POOLED_KINDS.get(pool) if isinstance(pool, str) else None


def tower_name(config: GridGeometry) -> str:
    """What a message calls the tower: its family's :attr:`~moonvit.families.Family.tower_name`
    (``classic ViT / DeiT tower``, ``MoonViT tower``); ``vision tower`` for a config no family builds."""
    from ..families import family_of  # the families build on the model package

    family = family_of(config)
    if family is None:
        return "vision tower"
    return family.tower_name or f"{family.name} tower"


def gives_hidden_states(config: EncoderConfig) -> bool:
    """Whether the tower's forward gives its blocks' hidden states (``hidden_state_indices``): every
    tower but OpenVLA's fused backbone, whose output is its two towers' second-to-last-block features
    (its config's ``gives_hidden_states`` False)."""
    return bool(getattr(config, "gives_hidden_states", True))


def tower_projection(encoder: VisionEncoder) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The projector to LLM tokens that ``encoder`` carries itself, as a function of its merged tokens
    (n, 1, D) -> (n, T), in the projector's dtype: OpenVLA's fused backbone, whose folder holds Prismatic's
    projector beside the towers (its ``project``, the config's ``text_hidden_size`` T). None for a tower
    without one: MoonViT's projector is a module of its own
    (:class:`~moonvit.model.projector.MoonViTProjector`, read from the folder apart), a ViT tower has none,
    and a fused backbone saved without its projector (``text_hidden_size`` None) neither."""
    project = getattr(encoder, "project", None)
    width = getattr(encoder.config, "text_hidden_size", None)
    if not callable(project) or not isinstance(width, int) or encoder.config.tokens_per_merge != 1:
        return None

    def projection(merged: torch.Tensor) -> torch.Tensor:
        if merged.ndim != 3 or merged.shape[1] != 1:
            raise ValueError(f"the tower's projector takes merged tokens (n, 1, D), got {tuple(merged.shape)}")
        return project(merged[:, 0])

    return projection
