"""The ONNX graph's inputs for one pack of a classic ViT / DeiT tower, computed with NumPy.

As for MoonViT (:mod:`moonvit.onnx.inputs`), the graph holds the network and every weight;
what a pack's grids determine comes in as tensors, so that one graph serves any number of
images of any grids (odd sides included: the tower has no merger):

=======================  =====================  ===========================================
name                     shape, dtype           meaning
=======================  =====================  ===========================================
``pixel_values``         (L, 3, p, p) float32   every image's patches in raster order,
                                                images concatenated
``pos_emb_weight_h``     (U, G) float32         for each of the U patches of the pack's
                                                distinct (h, w) sizes, the weight of each of
                                                the table's G rows in its resampled row
``pos_emb_weight_w``     (U, G) float32         the same for the table's G columns
``pos_emb_row``          (L,) int64             each patch's entry among those U
``attention_rows``       (N, M) int64           item i's token rows (its prefix tokens, then
                                                its patches), padded with -1 to M, the most
                                                tokens of an item
``attention_slots``      (L,) int64             each patch row's place i * M + j in that
                                                padded batch
=======================  =====================  ===========================================

G is the table's native grid side (``config.grid_side``). The table's patch rows are resampled
to an h x w grid by the checkpoint's own rule (``config.pos_emb_rule``), and each rule is
separable: output row r reads the table's rows with weights ``W_h[r]`` and output column c its
columns with ``W_w[c]``, so the resampled entry (r, c) is ``sum_ij W_h[r, i] W_w[c, j] T[i, j]``.
:func:`axis_weights` computes ``W`` with NumPy, in float64, from the sizes alone (never from the
weights); the graph multiplies them into the table it holds, so the ``.onnx`` file is the whole
model. The weights are those of PyTorch's kernels (``F.interpolate``): bicubic (a = -0.75,
borders clamped) for ``transformers`` and ``transformers-f32``, antialiased bicubic (a = -0.5,
the support widened by the shrink factor, each row normalised) for ``timm``, bilinear through the
corner rows (``align_corners=True``) for ``jax``, antialiased bilinear (the triangle filter, widened
and normalised as ``timm``'s cubic) for ``naflex``. At the native size every rule's weights are the
identity, NaFlex's too (its kernel at scale 1 reads each row alone).

The graph's token rows are every item's prefix tokens first (item after item, CLS first), then
the L patch rows; ``attention_rows`` points into that layout.

Bad input raises the model's own errors (the checks are :mod:`moonvit.model.grid`'s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..families.vit.config import ClassicViTConfig
from ..model.grid import check_pixel_shape
from ..model.position import axis_taps
from .inputs import _check_grid, _segments

VIT_INPUT_NAMES = (
    "pixel_values",
    "pos_emb_weight_h",
    "pos_emb_weight_w",
    "pos_emb_row",
    "attention_rows",
    "attention_slots",
)
"""The inputs of a classic-ViT graph, in the graph's order."""


def vit_onnx_inputs(config: ClassicViTConfig, pixel_values: Any, grid_hws: Any) -> dict[str, np.ndarray]:
    """The feeds of a classic-ViT graph for one pack (see the module docstring).

    Args:
        config: the exported tower's config.
        pixel_values: (L, 3, p, p) floating array (NumPy, or anything ``np.asarray`` takes).
        grid_hws: (N, 2) integer rows (h, w), or (N, 3) rows (1, h, w).

    Raises:
        TypeError, ValueError: the model's errors for the same input.
    """
    thws = _check_grid(grid_hws, config)
    pixels = np.asarray(pixel_values)
    num_patches = sum(h * w for _, h, w in thws)
    check_pixel_shape(pixels.shape, pixels.dtype.kind == "f", pixels.dtype, config, num_patches, 1)
    return {"pixel_values": np.ascontiguousarray(pixels, dtype=np.float32), **vit_pack_layout(thws, config)}


def vit_pack_layout(thws: Sequence[tuple[int, int, int]], config: ClassicViTConfig) -> dict[str, np.ndarray]:
    """Every grid-dependent input (all but ``pixel_values``) of a pack of checked (1, h, w) items."""
    hw = np.array([(h, w) for _, h, w in thws], dtype=np.int64).reshape(-1, 2)
    seqlens = hw[:, 0] * hw[:, 1]
    starts, item, local = _segments(seqlens)
    return {
        **_table_weights(hw, item, local, config),
        **_attention_layout(seqlens, starts, item, local, config.num_prefix_tokens),
    }


def axis_weights(out_size: int, in_size: int, rule: str) -> np.ndarray:
    """(out_size, in_size) float64: the weight of each table row (or column) in each resampled one.

    One axis of ``F.interpolate`` from ``in_size`` to ``out_size`` as ``rule`` calls it (see
    :data:`~moonvit.families.vit.config.POS_EMB_RULES`); every rule leaves a native axis as it is.
    """
    if out_size < 1 or in_size < 1:
        raise ValueError(f"axis_weights needs sizes of at least 1, got {in_size} -> {out_size}")
    if out_size == in_size:
        return np.eye(in_size)
    out = np.arange(out_size)
    weights = np.zeros((out_size, in_size))
    if rule in ("transformers", "transformers-f32"):  # the same kernel; the graph computes in float32 either way
        taps, tap_weights = axis_taps(out, np.full(out_size, out_size), in_size, "bicubic")
        np.add.at(weights, (np.broadcast_to(out[:, None], taps.shape), taps), tap_weights)
    elif rule == "timm":
        weights = _antialiased(out_size, in_size, _cubic, 2.0)
    elif rule == "naflex":
        weights = _antialiased(out_size, in_size, _triangle, 1.0)
    elif rule == "jax":
        # align_corners=True: output i samples the source at i * (in - 1) / (out - 1) (0 for one row).
        source = out * ((in_size - 1) / (out_size - 1)) if out_size > 1 else np.zeros(1)
        base = np.minimum(np.floor(source).astype(np.int64), in_size - 1)
        frac = source - base
        np.add.at(weights, (out, base), 1 - frac)
        np.add.at(weights, (out, np.minimum(base + 1, in_size - 1)), frac)
    else:
        raise ValueError(f"unknown table rule {rule!r}")
    return weights


def _antialiased(out_size: int, in_size: int, kernel: Callable[[np.ndarray], np.ndarray], reach: float) -> np.ndarray:
    """PyTorch's ``antialias=True, align_corners=False`` along one axis (PIL's filters): ``kernel`` is the
    cubic (a = -0.5, ``reach`` 2) for ``bicubic``, the triangle (``reach`` 1) for ``bilinear``.

    Output i is centred on source coordinate ``scale * (i + 0.5)``, scale = in / out; the kernel is
    stretched by the scale when shrinking (support ``reach * scale``, never under ``reach``), cut at the
    borders, and each row is normalised to sum to 1.
    """
    scale = in_size / out_size
    support, stretch = (reach * scale, 1.0 / scale) if scale >= 1.0 else (reach, 1.0)
    weights = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = scale * (i + 0.5)
        # int() truncates as the kernel's int64 cast does (the max makes its rounding of negatives moot).
        first = max(int(center - support + 0.5), 0)
        end = min(int(center + support + 0.5), in_size)
        taps = kernel(np.abs((np.arange(first, end) - center + 0.5) * stretch))
        total = taps.sum()
        weights[i, first:end] = taps / total if total != 0 else taps
    return weights


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    """Keys' cubic of |x| (``x`` >= 0): one piece below 1, another below 2, 0 from 2 on."""
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = np.where(x < 2.0, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0)
    return np.where(x < 1.0, near, far)


def _triangle(x: np.ndarray) -> np.ndarray:
    """The bilinear (triangle) filter of |x| (``x`` >= 0): 1 - x below 1, 0 from 1 on."""
    return np.maximum(1.0 - x, 0.0)


def _table_weights(
    hw: np.ndarray, item: np.ndarray, local: np.ndarray, config: ClassicViTConfig
) -> dict[str, np.ndarray]:
    """The table resampled once per distinct (h, w) of the pack: per-axis weights of each entry of
    those sizes' rasters, and each patch's entry."""
    side, rule = config.grid_side, config.pos_emb_rule
    sizes, size_of_item = np.unique(hw, axis=0, return_inverse=True)
    size_starts = np.cumsum(sizes[:, 0] * sizes[:, 1]) - sizes[:, 0] * sizes[:, 1]
    weight_h, weight_w = [], []
    for h, w in sizes.tolist():
        weight_h.append(np.repeat(axis_weights(h, side, rule), w, axis=0))  # row r for entries r * w + c
        weight_w.append(np.tile(axis_weights(w, side, rule), (h, 1)))  # column c for entries r * w + c
    return {
        "pos_emb_weight_h": np.concatenate(weight_h).astype(np.float32),
        "pos_emb_weight_w": np.concatenate(weight_w).astype(np.float32),
        "pos_emb_row": size_starts[size_of_item.reshape(-1)[item]] + local,
    }


def _attention_layout(
    seqlens: np.ndarray, starts: np.ndarray, item: np.ndarray, local: np.ndarray, prefix: int
) -> dict[str, np.ndarray]:
    """Items as a batch padded to the most tokens: (N, M) token rows (each item's ``prefix`` tokens,
    rows i * prefix + k, then its patches, rows N * prefix + its packed rows; -1 past its end), and
    the place of each patch row in that batch. The graph places the prefix rows itself."""
    items = len(seqlens)
    tokens = seqlens + prefix
    longest = int(tokens.max())
    offsets = np.arange(longest)
    prefix_rows = np.arange(items)[:, None] * prefix + offsets
    patch_rows = items * prefix + starts[:, None] + offsets - prefix
    rows = np.where(offsets < prefix, prefix_rows, patch_rows)
    rows = np.where(offsets < tokens[:, None], rows, -1)
    return {"attention_rows": rows, "attention_slots": item * longest + prefix + local}
