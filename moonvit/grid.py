"""Per-call grid metadata of a packed batch of images.

Everything that depends only on the images' patch grids (sequence boundaries,
per-patch positions, RoPE angles, position-table resampling taps, merge order)
is computed once per forward by :func:`build_packed_grid`, vectorised over the
pack, and carried through the model in a :class:`PackedGrid`. Callers may build
it themselves and pass it in, so that the model's forward holds no host
synchronisation and compiles and exports cleanly.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from .config import MoonViTConfig
from .position import bicubic_resample_taps
from .rope import rope_rotation


@dataclass(frozen=True)
class AttentionGroup:
    """Images of one sequence length, attended to in one batched call.

    Attributes:
        seqlen: patches per image.
        num_images: images in the group.
        start: first packed row when the images are consecutive in the pack (their
            rows are then one slice, read as a view); None otherwise.
        token_index: (num_images, seqlen) int64 packed rows of each image, for
            groups that are not consecutive; None otherwise.
    """

    seqlen: int
    num_images: int
    start: int | None
    token_index: torch.Tensor | None


@dataclass(frozen=True)
class PackedGrid:
    """Grid metadata of a pack of N images holding L patches in total.

    Attributes:
        grid_hws: (N, 2) int64, patch rows and columns of each image.
        seqlens: N Python ints, h * w of each image.
        cu_seqlens: (N + 1,) int32, cumulative sequence lengths with a leading 0.
        max_seqlen: the longest image, in patches.
        positions: (L, 2) int64, (row, col) of each patch inside its own image.
        rope_rotation: (L, head_dim // 2) complex64, the RoPE rotation of each
            channel pair (pair 2i: column angle, 2i + 1: row angle).
        pos_emb_index: (U, 16) int64, bicubic taps into the flattened position
            table, for the U patches of the pack's distinct grid sizes.
        pos_emb_weight: (U, 16) float64, the weights of those taps.
        pos_emb_row: (L,) int64, each patch's row among those U, or None when every
            image has its own grid size (U = L, rows in order).
        merge_index: (L,) int64, packed row of each merged slot: ``x[merge_index]``
            viewed as (L / 4, 4, D) is the 2x2 patch merger's output.
        attention_groups: images grouped by sequence length for batched attention.
        pos_emb_sizes: the (h, w) grid sizes whose rasters make up the U rows, in
            order (lets the model cache each size's resampled table).
    """

    grid_hws: torch.Tensor
    seqlens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    rope_rotation: torch.Tensor
    pos_emb_index: torch.Tensor
    pos_emb_weight: torch.Tensor
    pos_emb_row: torch.Tensor | None
    merge_index: torch.Tensor
    attention_groups: tuple[AttentionGroup, ...]
    pos_emb_sizes: tuple[tuple[int, int], ...] | None = None

    @property
    def num_images(self) -> int:
        return len(self.seqlens)

    @property
    def num_patches(self) -> int:
        return int(sum(self.seqlens))

    def to(self, device: torch.device | str) -> "PackedGrid":
        """The same metadata with every tensor on ``device``."""
        moved = {
            name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in self.__dict__.items()
        }
        moved["attention_groups"] = tuple(
            dataclasses.replace(g, token_index=None if g.token_index is None else g.token_index.to(device))
            for g in self.attention_groups
        )
        return PackedGrid(**moved)


def validate_grid_hws(grid_hws: torch.Tensor | Sequence[Sequence[int]], config: MoonViTConfig) -> list[tuple[int, int]]:
    """Check a pack's grids and return them as Python (h, w) pairs.

    Raises:
        TypeError: grid_hws is not an integer (N, 2) tensor or nested sequence.
        ValueError: an empty pack, a non-positive side, a side over the RoPE
            table, or a side the patch merger cannot group.
    """
    if not isinstance(grid_hws, torch.Tensor):
        try:
            grid_hws = torch.as_tensor(grid_hws)
        except (TypeError, ValueError) as err:
            raise TypeError(f"grid_hws must be an (N, 2) integer tensor, got {type(grid_hws).__name__}") from err
    if grid_hws.dtype.is_floating_point or grid_hws.dtype.is_complex or grid_hws.dtype == torch.bool:
        raise TypeError(f"grid_hws must be an integer tensor, got dtype {grid_hws.dtype}")
    if grid_hws.ndim != 2 or grid_hws.shape[-1] != 2:
        raise TypeError(f"grid_hws must have shape (N, 2) = (rows, cols) per image, got {tuple(grid_hws.shape)}")
    if grid_hws.shape[0] == 0:
        raise ValueError("empty pack: grid_hws holds no image")
    kh, kw = config.merge_kernel_size
    grids = [(int(h), int(w)) for h, w in grid_hws.tolist()]
    for i, (h, w) in enumerate(grids):
        if h < 1 or w < 1:
            raise ValueError(f"image {i}: grid {h}x{w} has a non-positive side")
        if h > config.max_grid_side or w > config.max_grid_side:
            raise ValueError(
                f"image {i}: grid {h}x{w} exceeds the {config.max_grid_side} patches per side of the RoPE table"
            )
        if h % kh or w % kw:
            raise ValueError(
                f"image {i}: grid {h}x{w} is not divisible by the {kh}x{kw} patch merger "
                "(pad the image to a multiple of patch_size * merge_kernel_size)"
            )
    return grids


@dataclass(frozen=True)
class _Raster:
    """Raster coordinates of images packed in order: ``starts`` (N,), the rest (L,) int64."""

    starts: torch.Tensor  # first packed row of each image
    image: torch.Tensor  # which image
    offset: torch.Tensor  # first packed row of that image
    local: torch.Tensor  # index inside the image
    height: torch.Tensor  # the image's rows
    width: torch.Tensor  # the image's columns

    @property
    def positions(self) -> torch.Tensor:
        """(L, 2) (row, col) inside each image."""
        return torch.stack([self.local // self.width, self.local % self.width], dim=-1)


def _raster(hw: torch.Tensor) -> _Raster:
    seqlens = hw[:, 0] * hw[:, 1]
    image = torch.repeat_interleave(torch.arange(len(hw)), seqlens, output_size=int(seqlens.sum()))
    starts = seqlens.cumsum(0) - seqlens
    offset = starts[image]
    return _Raster(starts, image, offset, torch.arange(len(image)) - offset, hw[image, 0], hw[image, 1])


# Packs up to this many patches are kept in an LRU cache, keyed by their grids:
# a robot's cameras or a fixed-resolution pipeline repeat the same pack.
CACHED_PACK_PATCHES = 65536


def build_packed_grid(
    grid_hws: torch.Tensor | Sequence[Sequence[int]],
    config: MoonViTConfig,
    device: torch.device | str | None = None,
) -> PackedGrid:
    """Validate ``grid_hws`` (N, 2) and compute the pack's metadata on ``device``.

    Packs of up to ``CACHED_PACK_PATCHES`` come from an LRU cache of 16, so their
    tensors are shared: treat them as read-only. They are normal tensors even
    when built under ``torch.inference_mode``, so a training step can use them.
    """
    grids = tuple(validate_grid_hws(grid_hws, config))
    geometry = (
        config.head_dim,
        config.rope_theta,
        config.init_pos_emb_height,
        config.init_pos_emb_width,
        tuple(config.merge_kernel_size),
    )
    device = None if device is None else torch.device(device)
    if sum(h * w for h, w in grids) <= CACHED_PACK_PATCHES:
        return _cached_grid(grids, geometry, device)
    return _build(grids, geometry, device)


def clear_grid_cache() -> None:
    _cached_grid.cache_clear()


@functools.lru_cache(maxsize=16)
def _cached_grid(grids: tuple[tuple[int, int], ...], geometry: tuple, device: torch.device | None) -> PackedGrid:
    return _build(grids, geometry, device)


# Normal tensors even inside inference mode, so that a later training step can use them.
@torch.inference_mode(False)
def _build(grids: tuple[tuple[int, int], ...], geometry: tuple, device: torch.device | None) -> PackedGrid:
    head_dim, rope_theta, table_height, table_width, (kh, kw) = geometry
    hw = torch.tensor(grids, dtype=torch.int64)
    seqlens = hw[:, 0] * hw[:, 1]
    cu_seqlens = torch.zeros(len(grids) + 1, dtype=torch.int32)
    cu_seqlens[1:] = seqlens.cumsum(0)
    patches = _raster(hw)
    positions = patches.positions
    offset, local, width = patches.offset, patches.local, patches.width

    rotation = rope_rotation(positions, head_dim, rope_theta)
    # Images of equal grid size share their resampled position table (several
    # cameras of one resolution, say): resample each distinct size once.
    distinct, grid_of_image = torch.unique(hw, dim=0, return_inverse=True)
    resampled = patches if len(distinct) == len(grids) else _raster(distinct)
    taps, weights = bicubic_resample_taps(
        resampled.positions, resampled.height, resampled.width, table_height, table_width
    )
    if resampled is patches:
        pos_emb_row, pos_emb_sizes = None, grids
    else:
        pos_emb_row = resampled.starts[grid_of_image][patches.image] + local
        pos_emb_sizes = tuple((int(h), int(w)) for h, w in distinct.tolist())

    # Merger: slot `local` of an image is entry q of merged token g, which reads
    # the patch at (row, col) = (g_row * kh + q // kw, g_col * kw + q % kw).
    group, within = local // (kh * kw), local % (kh * kw)
    merged_width = width // kw
    source_row = (group // merged_width) * kh + within // kw
    source_col = (group % merged_width) * kw + within % kw
    merge_index = offset + source_row * width + source_col

    groups = []
    for seqlen in sorted(set(seqlens.tolist())):
        images = (seqlens == seqlen).nonzero().flatten()
        first, count = int(images[0]), len(images)
        if int(images[-1]) - first + 1 == count:
            groups.append(AttentionGroup(seqlen, count, int(patches.starts[first]), None))
        else:
            rows = patches.starts[images, None] + torch.arange(seqlen)
            groups.append(AttentionGroup(seqlen, count, None, rows))

    grid = PackedGrid(
        grid_hws=hw,
        seqlens=tuple(int(s) for s in seqlens.tolist()),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(seqlens.max()),
        positions=positions,
        rope_rotation=rotation,
        pos_emb_index=taps,
        pos_emb_weight=weights,
        pos_emb_row=pos_emb_row,
        pos_emb_sizes=pos_emb_sizes,
        merge_index=merge_index,
        attention_groups=tuple(groups),
    )
    return grid if device is None else grid.to(device)
