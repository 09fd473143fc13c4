"""The ONNX graph's inputs for one pack, computed with NumPy.

The exported graph holds the network only; everything a pack's grids determine
comes in as tensors, so one graph serves packs of any number of images and
clips of any sizes. :func:`onnx_inputs` computes them with NumPy alone (no
torch operation), the same values as :func:`~moonvit.model.grid.build_packed_grid`:

========================  =====================  ==========================================
name                      shape, dtype           meaning
========================  =====================  ==========================================
``pixel_values``          (L, 3, p, p) float32   every item's patches, frame after frame,
                                                 each frame in raster order
``positions``             (L, 2) int64           (row, col) of each patch in its frame
                                                 (the graph turns them into RoPE angles)
``pos_emb_index``         (U, 16) int64          bicubic taps into the flattened position
                                                 table, for the U patches of the pack's
                                                 distinct (h, w) sizes
``pos_emb_weight``        (U, 16) float32        the weights of those taps
``pos_emb_row``           (L,) int64             each patch's entry among those U
``attention_rows``        (N, M) int64           item i's packed rows, padded with -1 to
                                                 M, the longest item
``attention_slots``       (L,) int64             each packed row's place i * M + j in
                                                 that padded batch
``merge_index``           (S/4, 4, T) int64      the rows merged into each token's 2x2
                                                 group, one per frame (T: most frames)
``merge_weight``          (S/4, 4, T) float32    1 / t for a clip's t frames, 0 for padding
``time_index``            (L,) int64             K2.5 towers only: 1 + frame of each row of
                                                 a clip with t > 1, 0 otherwise
========================  =====================  ==========================================

Bad input raises the model's own errors (the checks are shared with
:mod:`moonvit.model.grid`).

A classic ViT / DeiT tower's graph takes other inputs (:mod:`moonvit.onnx.vit_inputs`);
:func:`onnx_inputs` and :func:`input_names` answer for either tower by its config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..families.vit.config import ClassicViTConfig
from ..model.config import MoonViTConfig
from ..model.grid import GridGeometry, check_grid_rows, check_pixel_shape

INPUT_NAMES = (
    "pixel_values",
    "positions",
    "pos_emb_index",
    "pos_emb_weight",
    "pos_emb_row",
    "attention_rows",
    "attention_slots",
    "merge_index",
    "merge_weight",
    "time_index",
)
"""Every input a graph may take, in the graph's order; ``time_index`` only for towers with a
temporal table (:func:`input_names`)."""


def input_names(config: MoonViTConfig | ClassicViTConfig) -> tuple[str, ...]:
    """The inputs of the graph exported from an encoder of ``config``."""
    if isinstance(config, ClassicViTConfig):
        from .vit_inputs import VIT_INPUT_NAMES

        return VIT_INPUT_NAMES
    return INPUT_NAMES if config.init_pos_emb_time else INPUT_NAMES[:-1]


def onnx_inputs(config: MoonViTConfig | ClassicViTConfig, pixel_values: Any, grid_hws: Any) -> dict[str, np.ndarray]:
    """The feeds of an exported graph for one pack.

    Args:
        config: the exported encoder's config (``encoder.config``, or
            :func:`~moonvit.onnx.onnx_config` of an ONNX Runtime session); a classic ViT's
            takes :func:`~moonvit.onnx.vit_inputs.vit_onnx_inputs`.
        pixel_values: (L, 3, p, p) floating array (NumPy, or anything ``np.asarray``
            takes), as the encoder takes it.
        grid_hws: (N, 2) integer rows (h, w), or (N, 3) rows (t, h, w).

    Returns:
        ``{name: array}`` for every input of the graph (see the module docstring).

    Raises:
        TypeError, ValueError: the model's errors for the same input: grids that are not
            (N, 2) / (N, 3) integers, an empty pack, sides that are odd, non-positive or
            over ``max_grid_side``, more frames than the temporal table has, pixel values
            that are not floating, of another patch shape, or another count than the grids'.
    """
    if isinstance(config, ClassicViTConfig):
        from .vit_inputs import vit_onnx_inputs

        return vit_onnx_inputs(config, pixel_values, grid_hws)
    thws = _check_grid(grid_hws, config)
    pixels = np.asarray(pixel_values)
    num_patches = sum(t * h * w for t, h, w in thws)
    max_frames = max(t for t, _, _ in thws)
    check_pixel_shape(pixels.shape, pixels.dtype.kind == "f", pixels.dtype, config, num_patches, max_frames)
    feeds = {"pixel_values": np.ascontiguousarray(pixels, dtype=np.float32), **pack_layout(thws, config)}
    if not config.init_pos_emb_time:
        del feeds["time_index"]
    return feeds


def _check_grid(grid_hws: Any, config: GridGeometry) -> list[tuple[int, int, int]]:
    """The model's grid checks (:func:`~moonvit.model.grid.validate_grid_thws`) on a NumPy array."""
    try:
        grid = np.asarray(grid_hws)
    except (TypeError, ValueError) as err:
        raise TypeError(f"grid_hws must be an (N, 2) or (N, 3) integer tensor, got {type(grid_hws).__name__}") from err
    if grid.dtype.kind not in "iu":
        raise TypeError(f"grid_hws must be an integer tensor, got dtype {grid.dtype}")
    return check_grid_rows(grid.shape, grid.tolist(), config)


def pack_layout(thws: Sequence[tuple[int, int, int]], config: MoonViTConfig) -> dict[str, np.ndarray]:
    """Every grid-dependent input (all but ``pixel_values``) of a pack of checked (t, h, w) items."""
    thw = np.array(thws, dtype=np.int64).reshape(-1, 3)
    frames, heights, widths = thw.T
    frame_sizes = heights * widths
    seqlens = frames * frame_sizes
    starts, item, local = _segments(seqlens)
    spatial = local % frame_sizes[item]  # index inside the frame
    width = widths[item]
    positions = np.stack([spatial // width, spatial % width], axis=-1)
    frame = local // frame_sizes[item]
    return {
        "positions": positions,
        **_position_taps(thw, item, spatial, config),
        **_attention_layout(seqlens, starts, item, local),
        **_merge_layout(frames, frame_sizes, item, frame, positions, width, config),
        "time_index": np.where(frames[item] > 1, frame + 1, 0),
    }


def _segments(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For consecutive segments of ``lengths`` (N,): starts (N,), and per row the segment and local index."""
    starts = np.cumsum(lengths) - lengths
    owner = np.repeat(np.arange(len(lengths)), lengths)
    return starts, owner, np.arange(len(owner)) - starts[owner]


def _position_taps(
    thw: np.ndarray, item: np.ndarray, spatial: np.ndarray, config: MoonViTConfig
) -> dict[str, np.ndarray]:
    """The position table resampled once per distinct (h, w) of the pack (a clip's frames, repeated
    camera sizes), as the config's resampling taps; each row reads its size's entry."""
    sizes, size_of_item = np.unique(thw[:, 1:], axis=0, return_inverse=True)
    size_starts, size_owner, size_local = _segments(sizes[:, 0] * sizes[:, 1])
    size_heights, size_widths = sizes[size_owner, 0], sizes[size_owner, 1]
    size_positions = np.stack([size_local // size_widths, size_local % size_widths], axis=-1)
    taps, weights = config.position_taps(size_positions, size_heights, size_widths)
    return {
        "pos_emb_index": taps,
        "pos_emb_weight": weights.astype(np.float32),
        "pos_emb_row": size_starts[size_of_item.reshape(-1)[item]] + spatial,
    }


def _attention_layout(
    seqlens: np.ndarray, starts: np.ndarray, item: np.ndarray, local: np.ndarray
) -> dict[str, np.ndarray]:
    """Items as a batch padded to the longest: (N, M) rows (-1 past an item's end), and the
    place of each packed row in that batch."""
    longest = int(seqlens.max())
    offsets = np.arange(longest)
    rows = np.where(offsets < seqlens[:, None], starts[:, None] + offsets, -1)
    return {"attention_rows": rows, "attention_slots": item * longest + local}


def _merge_layout(
    frames: np.ndarray,
    frame_sizes: np.ndarray,
    item: np.ndarray,
    frame: np.ndarray,
    positions: np.ndarray,
    width: np.ndarray,
    config: MoonViTConfig,
) -> dict[str, np.ndarray]:
    """The merger as a gather: for each merged slot (S = sum h * w), the row of each frame and 1 / t.

    The patch at (row, col) of a frame fills entry (row % kh) * kw + col % kw of merged
    token (row // kh) * (w // kw) + col // kw of its item, as in the model; frames past
    an item's t point at its first frame with weight 0.
    """
    kh, kw = config.merge_kernel_size
    row, col = positions.T
    group = (row // kh) * (width // kw) + col // kw
    slot = (np.cumsum(frame_sizes) - frame_sizes)[item] + group * (kh * kw) + (row % kh) * kw + col % kw
    num_slots, most_frames = int(frame_sizes.sum()), int(frames.max())
    index = np.zeros((num_slots, most_frames), dtype=np.int64)
    weight = np.zeros((num_slots, most_frames), dtype=np.float32)
    index[slot, frame] = np.arange(len(slot))
    weight[slot, frame] = np.float32(1.0) / frames[item].astype(np.float32)
    index = np.where(weight > 0, index, index[:, :1])
    group_shape = (num_slots // (kh * kw), kh * kw, most_frames)
    return {"merge_index": index.reshape(group_shape), "merge_weight": weight.reshape(group_shape)}
