"""Per-layer features of any tower: the one way to read chosen blocks' outputs from a packed forward.

What stacks read of a ViT besides its last output: Prismatic / OpenVLA the second-to-last block
(timm's ``get_intermediate_layers(n={depth - 2})``), LLaVA the same, DINOv2's linear evaluation
the last four blocks after the final norm (``get_intermediate_layers(n=4, norm=True)``), timm's
``forward_intermediates`` any chosen blocks. :func:`intermediates` gives them for every tower
(MoonViT of every family; the ViT tower: ViT, DeiT, SigLIP, DINOv2) on one pack:

    feats = intermediates(encoder, pixel_values, grid_thws, indices=(-2,))  # Prismatic's block
    feats.patch_tokens[0]   # (L, D) its patch rows, aligned with pixel_values
    feats.prefix_tokens[0]  # (N, n_prefix, D) each image's CLS / registers (None for MoonViT)
    dino = intermediates(encoder, pixel_values, grid_thws, indices=4, norm=True)  # DINOv2's

Indices count the hidden states as ``hidden_state_indices`` does: 0 is the embeddings, i is block
i's output (1-based), negative from the end (-1 the last block, -2 the one before: timm's negative
block indices); an int n is the last n blocks (timm's and DINOv2's ``n``). ``norm=True`` passes each
through the tower's final norm (``final_norm``), as timm's ``norm=True`` does; the last block's,
normed, are the forward's own ``last_hidden_state`` and ``prefix_tokens``, bit for bit.

:func:`read_intermediates` is the second half alone, for a caller that ran the forward itself with
``hidden_state_indices=intermediate_indices(...)`` (the probe, through :mod:`moonvit.encode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from .encoder import MoonViTOutput, hidden_indices
from .grid import GridInput, PackedGrid
from .interface import VisionEncoder

__all__ = ["Intermediates", "intermediate_indices", "intermediates", "read_intermediates"]


@dataclass(frozen=True)
class Intermediates:
    """Chosen blocks' outputs of one packed forward over N items with L patch rows.

    Attributes:
        indices: the hidden states read, resolved (0 = embeddings, i = block i's output), in the order asked.
        patch_tokens: per index, (L, D) the patch rows, aligned with ``pixel_values`` (items concatenated).
        prefix_tokens: per index, (N, n_prefix, D) each item's prefix rows (CLS first, then DeiT's
            distillation token or DINOv2's registers; n_prefix may be 0: a SigLIP-like tower); None
            for a tower that has no prefix rows at all (MoonViT).
        normed: whether the rows went through the tower's final norm.
        output: the forward's own output (``last_hidden_state``, ``pooled``, ... after the final norm).
    """

    indices: tuple[int, ...]
    patch_tokens: tuple[torch.Tensor, ...]
    prefix_tokens: tuple[torch.Tensor, ...] | None
    normed: bool
    output: MoonViTOutput


def intermediate_indices(num_blocks: int, indices: int | Sequence[int]) -> tuple[int, ...]:
    """``indices`` resolved against a tower of ``num_blocks`` blocks: an int n the last n blocks
    (num_blocks - n + 1 .. num_blocks); a sequence, each hidden-state index (0 = embeddings, i = block
    i's output, negative from the end) made non-negative, in order.

    Raises:
        ValueError: n outside 1 .. num_blocks, an index out of range, or no index at all (each named).
        TypeError: an index that is not an int.
    """
    if isinstance(indices, bool):
        raise TypeError(f"intermediates: indices {indices!r} is neither an int n (the last n blocks) nor indices")
    if isinstance(indices, int):
        if not 1 <= indices <= num_blocks:
            raise ValueError(
                f"intermediates: indices={indices} asks for the last {indices} blocks of a tower of {num_blocks}"
                f" (an int n takes 1 .. {num_blocks})"
            )
        return tuple(range(num_blocks - indices + 1, num_blocks + 1))
    indices = tuple(indices)
    if not indices:
        raise ValueError("intermediates: no indices asked (give block indices, or an int n: the last n blocks)")
    return hidden_indices(num_blocks + 1, False, indices, what="intermediates index")


def intermediates(
    encoder: VisionEncoder,
    pixel_values: torch.Tensor,
    grid_thws: GridInput | None = None,
    *,
    grid: PackedGrid | None = None,
    indices: int | Sequence[int] = (-2,),
    norm: bool = False,
) -> Intermediates:
    """Run ``encoder`` on one pack and return the chosen blocks' outputs (see the module docstring).

    Args:
        encoder: any tower (:class:`~moonvit.model.interface.VisionEncoder` with ``final_norm`` for
            ``norm=True``), in whatever mode it is; autograd as the caller has it.
        pixel_values, grid_thws, grid: the pack, as the encoder's own call takes it.
        indices: an int n (the last n blocks), or hidden-state indices (0 = embeddings, i = block i's
            output, negative from the end). Default: the second-to-last block (Prismatic's, LLaVA's).
        norm: pass the rows through the tower's final norm (timm's ``norm=True``, DINOv2's linear evaluation).

    Returns:
        :class:`Intermediates`: per index (L, D) patch rows and, for a tower with prefix rows,
        (N, n_prefix, D) prefix rows, in the encoder's dtype.
    """
    kept = intermediate_indices(encoder.config.num_hidden_layers, indices)
    output = encoder(pixel_values, grid_thws, grid=grid, hidden_state_indices=kept)
    return read_intermediates(encoder, output, kept, norm=norm)


def read_intermediates(
    encoder: VisionEncoder, output: MoonViTOutput, indices: Sequence[int], *, norm: bool = False
) -> Intermediates:
    """The :class:`Intermediates` of an ``output`` the caller's forward made with
    ``hidden_state_indices=indices`` (resolved: :func:`intermediate_indices`).

    Raises:
        ValueError: the output holds other hidden states than ``indices`` asks (or none).
        TypeError: ``norm`` for an encoder with no ``final_norm``.
    """
    indices = tuple(indices)
    hidden = output.hidden_states
    if hidden is None or len(hidden) != len(indices):
        held = "none" if hidden is None else len(hidden)
        raise ValueError(
            f"read_intermediates: the output holds {held} hidden states for {len(indices)} indices {indices}: "
            "call the encoder with hidden_state_indices=indices"
        )
    prefix = output.hidden_prefix_tokens
    if prefix is None and output.prefix_tokens is not None:
        raise ValueError("read_intermediates: the output has prefix rows, its hidden states none (the tower's bug)")
    if not norm:
        return Intermediates(indices, tuple(hidden), None if prefix is None else tuple(prefix), False, output)
    final = getattr(encoder, "final_norm", None)
    if not isinstance(final, nn.Module):
        raise TypeError(f"{type(encoder).__name__} has no final_norm module: intermediates cannot norm its rows")
    last = encoder.config.num_hidden_layers
    # the last block's rows, normed, are the forward's own outputs: taken as they are, the same bits
    patches = tuple(output.last_hidden_state if i == last else final(rows) for i, rows in zip(indices, hidden))
    normed_prefix = None
    if prefix is not None:
        assert output.prefix_tokens is not None
        normed_prefix = tuple(output.prefix_tokens if i == last else final(rows) for i, rows in zip(indices, prefix))
    return Intermediates(indices, patches, normed_prefix, True, output)
