"""Per-call grid metadata of a packed batch of images and clips.

Everything that depends only on the items' patch grids (sequence boundaries,
per-patch positions, RoPE angles, position-table resampling taps, frame
indices, merge order) is computed once per forward by
:func:`build_packed_grid`, vectorised over the pack, and carried through the
model in a :class:`PackedGrid`. Callers may build it themselves and pass it
in, so that the model's forward holds no host synchronisation and compiles and
exports cleanly.

An item is an image (t = 1) or a clip of t frames of one h x w grid; its
t * h * w patches are packed frame after frame, each frame in raster order,
and attend to each other and to nothing else. Training may keep only some
patches of each item (token dropping, MAE): each kept patch keeps the
position, RoPE angles and frame of its place in the full grid.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .position import resample_taps
from .rope import rope_rotation


class GridGeometry(Protocol):
    """What the grid reads of a tower's config (:class:`~moonvit.model.config.MoonViTConfig`, or another
    family's, such as the classic ViT's): patch and merge sizes, limits, and the RoPE / table geometry."""

    @property
    def patch_size(self) -> int: ...
    @property
    def num_channels(self) -> int: ...
    @property
    def max_grid_side(self) -> int: ...
    @property
    def merge_kernel_size(self) -> tuple[int, int]: ...
    @property
    def max_frames(self) -> int: ...
    @property
    def init_pos_emb_time(self) -> int: ...
    @property
    def init_pos_emb_height(self) -> int: ...
    @property
    def init_pos_emb_width(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def pos_emb_interpolation_mode(self) -> str: ...


GridInput = torch.Tensor | Sequence[Sequence[int]]
"""(N, 2) rows (h, w) of images, or (N, 3) rows (t, h, w) of clips and images (t = 1)."""


@dataclass(frozen=True)
class AttentionGroup:
    """Items of one sequence length, attended to in one batched call.

    Attributes:
        seqlen: packed rows per item.
        num_images: items in the group.
        start: first packed row when the items are consecutive in the pack (their
            rows are then one slice, read as a view); None otherwise.
        token_index: (num_images, seqlen) int64 packed rows of each item, for
            groups that are not consecutive; None otherwise.
    """

    seqlen: int
    num_images: int
    start: int | None
    token_index: torch.Tensor | None


@dataclass(frozen=True)
class PackedGrid:
    """Grid metadata of a pack of N items (images or clips) holding L packed rows.

    Attributes:
        grid_thws: (N, 3) int64, frames, patch rows and patch columns of each item.
        seqlens: N Python ints, the packed rows of each item (t * h * w, or the
            kept count when patches were dropped).
        cu_seqlens: (N + 1,) int32, cumulative sequence lengths with a leading 0.
        max_seqlen: the longest item, in rows.
        max_frames: the most frames of any item (1 for a pack of images).
        positions: (L, 2) int64, (row, col) of each patch inside its frame.
        item_index: (L,) int64, the item each row belongs to.
        rope_rotation: (L, head_dim // 2, 2) float32, (cos, sin) of the RoPE rotation of
            each channel pair (pair 2i: column angle, 2i + 1: row angle).
        pos_emb_index: (U, K) int64, resampling taps into the flattened position
            table (K = 16 bicubic, 4 bilinear), for the U patches of the pack's distinct (h, w) sizes.
        pos_emb_weight: (U, K) float64, the weights of those taps.
        pos_emb_row: (L,) int64, each row's entry among those U, or None when
            every image has its own size, no clip repeats frames and nothing was
            dropped (U = L, rows in order).
        pos_emb_sizes: the (h, w) sizes whose rasters make up the U rows, in order.
        time_index: (L,) int64, 1 + the frame of each row of a clip with t > 1 and
            0 for rows of items with t = 1 (which get no temporal embedding); None
            when the pack holds no such clip.
        merge_index: (S,) int64, S = L, for packs of images only: the packed row
            of each merged slot; ``x[merge_index]`` viewed as (L / 4, 4, D) is the
            2x2 patch merger's output. None otherwise.
        pool_index: (L,) int64, for packs with clips: the merged slot of each row
            (frames of a clip share slots and are averaged). None otherwise.
        pool_weight: (L,) float32, 1 / t of each row's item, beside ``pool_index``.
        num_slots: S, the merged slots (sum of h * w over the items); 0 when
            patches were dropped, where merging is undefined.
        attention_groups: items grouped by sequence length for batched attention.
    """

    grid_thws: torch.Tensor
    seqlens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    max_frames: int
    positions: torch.Tensor
    item_index: torch.Tensor
    rope_rotation: torch.Tensor
    pos_emb_index: torch.Tensor
    pos_emb_weight: torch.Tensor
    pos_emb_row: torch.Tensor | None
    pos_emb_sizes: tuple[tuple[int, int], ...]
    time_index: torch.Tensor | None
    merge_index: torch.Tensor | None
    pool_index: torch.Tensor | None
    pool_weight: torch.Tensor | None
    num_slots: int
    attention_groups: tuple[AttentionGroup, ...]

    @property
    def num_images(self) -> int:
        """N, the items (images and clips) of the pack."""
        return len(self.seqlens)

    num_items = num_images

    @property
    def num_patches(self) -> int:
        """L, the packed rows."""
        return int(sum(self.seqlens))

    @property
    def grid_hws(self) -> torch.Tensor:
        """(N, 2) int64 patch rows and columns of each item."""
        return self.grid_thws[:, 1:]

    @property
    def dropped(self) -> bool:
        """Whether rows are a subset of the items' patches (then there is no merged output)."""
        return self.num_slots == 0

    def to(self, device: torch.device | str) -> PackedGrid:
        """The same metadata with every tensor on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        groups = tuple(
            dataclasses.replace(g, token_index=None if g.token_index is None else g.token_index.to(device))
            for g in self.attention_groups
        )
        return dataclasses.replace(self, attention_groups=groups, **moved)


# ---- validation -------------------------------------------------------------------------------


def _item_name(index: int, t: int, h: int, w: int) -> str:
    return f"image {index}: grid {h}x{w}" if t == 1 else f"clip {index}: grid {t}x{h}x{w}"


def validate_grid_thws(grid: GridInput, config: GridGeometry) -> list[tuple[int, int, int]]:
    """Check a pack's grids and return them as Python (t, h, w) triples.

    Args:
        grid: (N, 2) integer rows (h, w) (images, t = 1) or (N, 3) rows (t, h, w).

    Raises:
        TypeError: not an integer (N, 2) or (N, 3) tensor or nested sequence.
        ValueError: an empty pack, a non-positive side or frame count, a side
            over the RoPE table, or a side the patch merger cannot group.
    """
    if not isinstance(grid, torch.Tensor):
        try:
            grid = torch.as_tensor(grid)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"grid_hws must be an (N, 2) or (N, 3) integer tensor, got {type(grid).__name__}") from err
    if grid.dtype.is_floating_point or grid.dtype.is_complex or grid.dtype == torch.bool:
        raise TypeError(f"grid_hws must be an integer tensor, got dtype {grid.dtype}")
    return check_grid_rows(tuple(grid.shape), grid.tolist(), config)


def check_grid_rows(shape: tuple[int, ...], rows: list, config: GridGeometry) -> list[tuple[int, int, int]]:
    """The checks of :func:`validate_grid_thws` on plain Python values, without torch.

    Args:
        shape: the grid array's shape.
        rows: its rows as Python integers (``array.tolist()``).

    Returns:
        The (t, h, w) triples, t = 1 for (h, w) rows.

    Raises:
        TypeError: a shape other than (N, 2) or (N, 3).
        ValueError: an empty pack, a non-positive side or frame count, more frames than
            the temporal table has rows, a side over the RoPE table, or a side the patch
            merger cannot group.
    """
    if len(shape) != 2 or shape[-1] not in (2, 3):
        raise TypeError(
            "grid_hws must have shape (N, 2) = (rows, cols) per image or (N, 3) = (frames, rows, cols) "
            f"per clip, got {shape}"
        )
    if shape[0] == 0:
        raise ValueError("empty pack: grid_hws holds no image")
    thws = [(1, int(r[0]), int(r[1])) if len(r) == 2 else (int(r[0]), int(r[1]), int(r[2])) for r in rows]
    kh, kw = config.merge_kernel_size
    for i, (t, h, w) in enumerate(thws):
        name = _item_name(i, t, h, w)
        if h < 1 or w < 1:
            raise ValueError(f"{name} has a non-positive side")
        if t < 1:
            raise ValueError(f"{name} has {t} frames; an item has at least 1")
        if t > config.max_frames:
            raise ValueError(
                f"{name} has {t} frames, over the {config.max_frames} this encoder takes"
                + (
                    f" (its temporal table has {config.init_pos_emb_time} rows; split longer clips into chunks)"
                    if config.init_pos_emb_time
                    else " (an image-only tower has no temporal embedding: for clips, use a Kimi-K2.5 / K2.6 tower)"
                )
            )
        if h > config.max_grid_side or w > config.max_grid_side:
            raise ValueError(
                f"{name} exceeds the {config.max_grid_side} patches per side this tower takes (max_grid_side)"
            )
        if h % kh or w % kw:
            raise ValueError(
                f"{name} is not divisible by the {kh}x{kw} patch merger "
                "(pad the image to a multiple of patch_size * merge_kernel_size)"
            )
    return thws


def check_pixel_shape(
    shape: tuple[int, ...],
    floating: bool,
    dtype: object,
    config: GridGeometry,
    num_patches: int,
    max_frames: int,
    dropped: bool = False,
) -> None:
    """Check a pack's ``pixel_values`` against its grid, without torch.

    Args:
        shape, floating, dtype: the pixel array's shape, whether its dtype is floating,
            and the dtype itself (for the message).
        num_patches: L, the rows the grid holds.
        max_frames: the most frames of any item (for the message).
        dropped: whether the grid keeps only some patches (for the message).

    Raises:
        TypeError: integer pixels (not yet normalised).
        ValueError: a shape other than (L, channels, patch, patch), or another L.
    """
    p, c = config.patch_size, config.num_channels
    if not floating:
        from .interface import tower_name  # the interface builds on the grid

        raise TypeError(
            f"pixel_values must be floating (normalised pixels), got {dtype}; run the images through the "
            f"{tower_name(config)}'s image processor (moonvit.processor_for(its checkpoint): its family's rule)"
        )
    if len(shape) != 4 or tuple(shape[1:]) != (c, p, p):
        raise ValueError(f"pixel_values must have shape (L, {c}, {p}, {p}), got {shape}")
    if shape[0] != num_patches:
        if dropped:
            total = f"the grid keeps {num_patches}"
        elif max_frames == 1:
            total = f"the grids add up to sum(h * w) = {num_patches}"
        else:
            total = f"the grids add up to sum(t * h * w) = {num_patches}"
        raise ValueError(f"pixel_values holds {shape[0]} patches but {total}")


def validate_keep(keep: Sequence[torch.Tensor], thws: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Check per-item kept-patch indices and return them as int64 CPU tensors.

    Raises:
        TypeError, ValueError: not one 1-D integer tensor per item, indices out of
            the item's ``t * h * w`` raster, not strictly increasing, or empty.
    """
    if len(keep) != len(thws):
        raise ValueError(f"keep holds {len(keep)} index tensors for a pack of {len(thws)} items")
    checked = []
    for i, (index, (t, h, w)) in enumerate(zip(keep, thws)):
        index = torch.as_tensor(index)
        if index.ndim != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
            raise TypeError(f"keep[{i}] must be a 1-D integer tensor, got {index.dtype} of shape {tuple(index.shape)}")
        index = index.to("cpu", torch.int64)
        if len(index) == 0:
            raise ValueError(f"keep[{i}] keeps no patch of item {i}")
        if int(index.min()) < 0 or int(index.max()) >= t * h * w:
            raise ValueError(f"keep[{i}] indexes outside item {i}'s {t * h * w} patches")
        if len(index) > 1 and not bool((index[1:] > index[:-1]).all()):
            raise ValueError(f"keep[{i}] must be strictly increasing (sorted, no repeats)")
        checked.append(index)
    return checked


def tokens_per_image(grid: GridInput, merge_kernel_size: Sequence[int] = (2, 2)) -> list[int]:
    """Merged (LLM) tokens of each item: h * w / (kh * kw), whatever its frame count.

    Args:
        grid: (N, 2) rows (h, w) or (N, 3) rows (t, h, w).

    Use it to split packed merged or projected outputs per item:
    ``out.merged.split(tokens_per_image(grid_hws))``.
    """
    kh, kw = merge_kernel_size
    rows = torch.as_tensor(grid).tolist()
    return [int(r[-2]) * int(r[-1]) // (kh * kw) for r in rows]


# ---- building ---------------------------------------------------------------------------------


def build_packed_grid(
    grid: GridInput,
    config: GridGeometry,
    device: torch.device | str | None = None,
    keep: Sequence[torch.Tensor] | None = None,
) -> PackedGrid:
    """Validate ``grid`` (N, 2) or (N, 3) and compute the pack's metadata on ``device``.

    Args:
        keep: training only: per item, the sorted indices (into its t * h * w
            patches, frame-major raster) of the patches that are fed; the others
            are dropped. The grid then describes only those rows and has no merge.

    Built as normal tensors even under ``torch.inference_mode``, so that a
    grid made during inference can serve a training step.
    """
    thws = validate_grid_thws(grid, config)
    kept = None if keep is None else validate_keep(keep, thws)
    return _build(tuple(thws), _geometry(config), kept, None if device is None else torch.device(device))


def _geometry(config: GridGeometry) -> tuple:
    return (
        config.head_dim,
        config.rope_theta,
        config.init_pos_emb_height,
        config.init_pos_emb_width,
        tuple(config.merge_kernel_size),
        config.pos_emb_interpolation_mode,
    )


class GridCache:
    """A small thread-safe LRU of built grids, for one model.

    Keyed by the grids, the model's geometry and the device; packs over
    ``max_patches`` rows are built but not kept. Entries are shared: treat their
    tensors as read-only.
    """

    def __init__(self, max_entries: int = 16, max_patches: int = 65536) -> None:
        self.max_entries = max_entries
        self.max_patches = max_patches
        self._entries: OrderedDict[tuple, PackedGrid] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, grid: GridInput, config: GridGeometry, device: torch.device | None) -> PackedGrid:
        thws = tuple(validate_grid_thws(grid, config))
        key = (thws, _geometry(config), device)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
        built = _build(thws, key[1], None, device)
        if built.num_patches <= self.max_patches:
            with self._lock:
                self._entries[key] = built
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        return built

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self) -> dict:  # copies and pickles start empty (and get their own lock)
        return {"max_entries": self.max_entries, "max_patches": self.max_patches}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]


def _segments(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For consecutive segments of ``lengths`` (N,): starts (N,), and per row the segment and local index."""
    starts = lengths.cumsum(0) - lengths
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=int(lengths.sum()))
    return starts, owner, torch.arange(len(owner)) - starts[owner]


# Normal tensors even inside inference mode, so that a later training step can use them.
@torch.inference_mode(False)
def _build(
    thws: tuple[tuple[int, int, int], ...],
    geometry: tuple,
    keep: list[torch.Tensor] | None,
    device: torch.device | None,
) -> PackedGrid:
    head_dim, rope_theta, table_height, table_width, (kh, kw), mode = geometry
    thw = torch.tensor(thws, dtype=torch.int64)
    frames, heights, widths = thw.unbind(1)
    frame_sizes = heights * widths
    full_starts, item, local = _segments(frames * frame_sizes)
    if keep is not None:
        rows = torch.cat([full_starts[i] + index for i, index in enumerate(keep)])
        item, local = item[rows], local[rows]
        seqlens = torch.tensor([len(index) for index in keep], dtype=torch.int64)
    else:
        seqlens = frames * frame_sizes
    frame_size, width = frame_sizes[item], widths[item]
    spatial = local % frame_size  # index inside the frame
    positions = torch.stack([spatial // width, spatial % width], dim=-1)
    rotation = rope_rotation(positions, head_dim, rope_theta)

    # The position table is resampled once per distinct (h, w) in the pack (several
    # cameras of one resolution, the frames of a clip), and each row reads its entry.
    sizes = thw[:, 1:]
    distinct, size_of_item = torch.unique(sizes, dim=0, return_inverse=True)
    direct = keep is None and len(distinct) == len(thws) and bool((frames == 1).all())
    if direct:
        pos_emb_sizes = tuple((h, w) for _, h, w in thws)
        taps, weights = resample_taps(positions, heights[item], width, table_height, table_width, mode)
        pos_emb_row = None
    else:
        pos_emb_sizes = tuple((int(h), int(w)) for h, w in distinct.tolist())
        size_starts, size_owner, size_local = _segments(distinct[:, 0] * distinct[:, 1])
        size_width = distinct[size_owner, 1]
        size_positions = torch.stack([size_local // size_width, size_local % size_width], dim=-1)
        taps, weights = resample_taps(
            size_positions, distinct[size_owner, 0], size_width, table_height, table_width, mode
        )
        pos_emb_row = size_starts[size_of_item[item]] + spatial

    frame = local // frame_size
    time_index = torch.where(frames[item] > 1, frame + 1, 0) if bool((frames > 1).any()) else None

    merge_index = pool_index = pool_weight = None
    num_slots = 0
    if keep is None:
        # Merger: the patch at (row, col) of a frame fills entry (row % kh) * kw + col % kw
        # of merged token (row // kh) * (w // kw) + col // kw of its item; frames share slots.
        row, col = positions.unbind(1)
        group = (row // kh) * (width // kw) + col // kw
        slot_starts = frame_sizes.cumsum(0) - frame_sizes
        slot = slot_starts[item] + group * (kh * kw) + (row % kh) * kw + col % kw
        num_slots = int(frame_sizes.sum())
        if time_index is None and bool((frames == 1).all()):
            merge_index = torch.empty_like(slot).index_copy_(0, slot, torch.arange(len(slot)))
        else:
            pool_index = slot
            pool_weight = (1.0 / frames[item].to(torch.float32)).contiguous()

    cu_seqlens, groups = _sequences(seqlens)
    grid = PackedGrid(
        grid_thws=thw,
        seqlens=tuple(int(s) for s in seqlens.tolist()),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(seqlens.max()),
        max_frames=int(frames.max()),
        positions=positions,
        item_index=item,
        rope_rotation=rotation,
        pos_emb_index=taps,
        pos_emb_weight=weights,
        pos_emb_row=pos_emb_row,
        pos_emb_sizes=pos_emb_sizes,
        time_index=time_index,
        merge_index=merge_index,
        pool_index=pool_index,
        pool_weight=pool_weight,
        num_slots=num_slots,
        attention_groups=groups,
    )
    return grid if device is None else grid.to(device)


def _sequences(seqlens: torch.Tensor) -> tuple[torch.Tensor, tuple[AttentionGroup, ...]]:
    """``cu_seqlens`` (N + 1,) int32 and the attention groups of consecutive items of ``seqlens`` (N,) rows."""
    starts = seqlens.cumsum(0) - seqlens
    cu_seqlens = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = seqlens.cumsum(0)
    groups = []
    for seqlen in sorted(set(seqlens.tolist())):
        members = (seqlens == seqlen).nonzero().flatten()
        first, count = int(members[0]), len(members)
        if int(members[-1]) - first + 1 == count:
            groups.append(AttentionGroup(seqlen, count, int(starts[first]), None))
        else:
            token_rows = starts[members, None] + torch.arange(seqlen)
            groups.append(AttentionGroup(seqlen, count, None, token_rows))
    return cu_seqlens, tuple(groups)


@dataclass(frozen=True)
class PrefixedPack:
    """A pack whose items each begin with ``count`` prefix tokens (CLS, DeiT's distillation token, registers).

    Attributes:
        grid: the token sequence's attention layout: its ``seqlens``, ``cu_seqlens``, ``max_seqlen``,
            ``attention_groups`` and ``item_index`` count each item's prefix rows first, then its patches;
            it has no per-patch fields (no positions, RoPE or merge), so it serves attention and
            per-item stochastic depth only.
        order: (N * count + L,) int64, for each token row, its row in ``cat([prefix rows (N * count, D),
            patch rows (L, D)])``: ``tokens = cat(...).index_select(0, order)``.
        patch_rows: (L,) int64, the token row of each patch, in pack order.
        prefix_rows: (N * count,) int64, the token rows of the prefix tokens, item-major.
    """

    grid: PackedGrid
    order: torch.Tensor
    patch_rows: torch.Tensor
    prefix_rows: torch.Tensor


@torch.inference_mode(False)
def prefixed_pack(grid: PackedGrid, count: int) -> PrefixedPack:
    """The layout of ``grid``'s pack with ``count`` prefix tokens before each item's rows, on its device."""
    seqlens = torch.tensor(grid.seqlens, dtype=torch.int64) + count
    cu_seqlens, groups = _sequences(seqlens)
    starts = cu_seqlens[:-1].to(torch.int64)
    items = len(seqlens)
    prefix_rows = (starts[:, None] + torch.arange(count)).flatten()
    _, owner, local = _segments(seqlens - count)
    patch_rows = starts[owner] + count + local
    order = torch.empty(int(seqlens.sum()), dtype=torch.int64)
    order[prefix_rows] = torch.arange(items * count)
    order[patch_rows] = items * count + torch.arange(len(patch_rows))
    empty = torch.empty(0, dtype=torch.int64)
    tokens = PackedGrid(
        grid_thws=grid.grid_thws.cpu(),
        seqlens=tuple(int(s) for s in seqlens.tolist()),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(seqlens.max()),
        max_frames=grid.max_frames,
        positions=empty.reshape(0, 2),
        item_index=torch.repeat_interleave(torch.arange(items), seqlens),
        rope_rotation=torch.empty(0, 0, 2),
        pos_emb_index=empty.reshape(0, 0),
        pos_emb_weight=torch.empty(0, 0, dtype=torch.float64),
        pos_emb_row=None,
        pos_emb_sizes=(),
        time_index=None,
        merge_index=None,
        pool_index=None,
        pool_weight=None,
        num_slots=0,
        attention_groups=groups,
    )
    device = grid.cu_seqlens.device
    return PrefixedPack(tokens.to(device), order.to(device), patch_rows.to(device), prefix_rows.to(device))
