"""The learnable 2D position table and its resampling to each image's grid.

MoonViT resizes its (64, 64, D) table to every image's (h, w) grid with
``F.interpolate(align_corners=False)`` and no antialiasing: bicubic in Kimi-VL and
K2.5, bilinear in Kimi K3. Both resizes are separable: each output patch reads a
fixed set of table rows with fixed weights (4 x 4 bicubic, 2 x 2 bilinear), so the
whole pack is one ``embedding_bag`` over precomputed taps instead of a per-image loop.
The taps are computed from the grid alone (:func:`resample_taps`), in float64 with NumPy,
for the model's grid and the ONNX graph's inputs alike.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .tracing import is_traced

ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)

# Keys' cubic convolution coefficient used by PyTorch's bicubic kernels.
CUBIC_A = -0.75
TAPS_PER_AXIS = {"bicubic": 4, "bilinear": 2}
"""Table rows each output reads along one axis; a resampled row reads the square of it."""


def cubic_weights(t: ArrayT) -> ArrayT:
    """(..., 4) weights of the taps at offsets -1, 0, 1, 2 for fractional offset t.

    Takes a torch tensor or a NumPy array (the ONNX graph's inputs are computed in NumPy),
    with the same float64 arithmetic either way.
    """
    a = CUBIC_A

    def near(x: ArrayT) -> ArrayT:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: ArrayT) -> ArrayT:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return _stack([far(t + 1), near(t), near(1 - t), far(2 - t)])


def _stack(parts: list[ArrayT]) -> ArrayT:
    return torch.stack(parts, dim=-1) if isinstance(parts[0], torch.Tensor) else np.stack(parts, axis=-1)


def axis_taps(
    index: np.ndarray, out_size: np.ndarray, in_size: int, mode: str = "bicubic"
) -> tuple[np.ndarray, np.ndarray]:
    """Taps (..., K) int64 and weights (..., K) float64 along one axis (K = 4 bicubic, 2 bilinear).

    Output coordinate ``index`` of an axis resized from ``in_size`` to ``out_size`` samples the
    source at ``(index + 0.5) * in_size / out_size - 0.5`` (half-pixel centres, align_corners=False).
    As in PyTorch's kernels, bilinear clamps that coordinate at 0 and reads the two neighbours;
    bicubic reads four and clamps the taps to the table's border.
    """
    source = (index.astype(np.float64) + 0.5) * (in_size / out_size.astype(np.float64)) - 0.5
    if mode == "bilinear":
        source = np.maximum(source, 0.0)
        base = np.floor(source)
        weights, offsets = np.stack([1 - (source - base), source - base], axis=-1), np.arange(2)
    elif mode == "bicubic":
        base = np.floor(source)
        weights, offsets = cubic_weights(source - base), np.arange(-1, 3)
    else:
        raise ValueError(f"pos_emb_interpolation_mode {mode!r} is not supported (only 'bicubic', 'bilinear')")
    return np.clip(base.astype(np.int64)[..., None] + offsets, 0, in_size - 1), weights


def resample_taps(
    positions: ArrayT,
    heights: ArrayT,
    widths: ArrayT,
    table_height: int,
    table_width: int,
    mode: str = "bicubic",
) -> tuple[ArrayT, ArrayT]:
    """Taps into a flattened (table_height * table_width, D) table, computed in float64 with NumPy
    and returned as the inputs are given (torch CPU tensors or NumPy arrays).

    Args:
        positions: (L, 2) int64 (row, col) of each patch.
        heights, widths: (L,) int64 grid size of each patch's image.
        mode: ``"bicubic"`` (16 taps) or ``"bilinear"`` (4 taps).

    Returns:
        taps: (L, K) int64 row indices into the flattened table.
        weights: (L, K) float64 weights; each row sums to 1.
    """
    arrays = [np.asarray(a) for a in (positions, heights, widths)]
    row_taps, row_weights = axis_taps(arrays[0][:, 0], arrays[1], table_height, mode)
    col_taps, col_weights = axis_taps(arrays[0][:, 1], arrays[2], table_width, mode)
    taps = (row_taps[:, :, None] * table_width + col_taps[:, None, :]).reshape(len(row_taps), -1)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(len(row_weights), -1)
    if isinstance(positions, torch.Tensor):
        return torch.from_numpy(taps), torch.from_numpy(weights)
    return taps, weights


def table_cache_key(weight: torch.Tensor) -> tuple | None:
    """The identity of a position table's weight now (object, storage, version, dtype, device), under
    which its resampled rows may be cached; None where they must not be: while the table trains
    (autograd records), under a tracer, for an inference tensor, or a weight with no storage
    (functorch-wrapped). An in-place change bumps the version; ``.data`` writes do not."""
    if is_traced() or (torch.is_grad_enabled() and weight.requires_grad) or weight.is_inference():
        return None
    try:
        return (id(weight), weight.data_ptr(), weight._version, weight.dtype, weight.device)
    except RuntimeError:  # functorch-wrapped or storage-less weights
        return None


class LearnablePositionTable(nn.Module):
    """A learnable (height, width, dim) table resampled to every image's grid.

    Optionally (``cache_patches > 0``, off by default) each grid size's
    resampled rows are kept in an LRU cache of at most that many rows, so a
    camera of fixed resolution pays for the resampling once. It is meant for
    inference with fixed weights: it is bypassed while the table is trained and
    dropped by ``load_state_dict``, ``.to()`` and in-place updates that bump
    the version counter, but weights changed through ``.data`` or by a fused
    optimizer step go unseen; call :meth:`clear_cache` after those.
    """

    def __init__(self, height: int, width: int, dim: int, cache_patches: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        nn.init.trunc_normal_(self.weight, std=0.02)
        self.cache_patches = cache_patches
        self._cache: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._cache_key: tuple | None = None
        self._lock = threading.Lock()

    def forward(
        self, taps: torch.Tensor, tap_weights: torch.Tensor, sizes: Sequence[tuple[int, int]] | None = None
    ) -> torch.Tensor:
        """(U, dim) position embeddings in the table's dtype.

        Args:
            taps, tap_weights: (U, K) from :func:`resample_taps`.
            sizes: the (h, w) grids whose rasters make up the U rows, in order;
                needed for the cache.

        Resampled in float32 (float64 tables stay float64) and rounded once,
        as F.interpolate does for low-precision inputs.
        """
        key = self._cache_key_now(sizes)
        if key is None or sizes is None:
            return self._resample(taps, tap_weights)
        with self._lock:
            if key != self._cache_key:
                self._cache.clear()
                self._cache_key = key
            parts = [self._cache[size] for size in sizes if size in self._cache]
            if len(parts) == len(sizes):
                for size in sizes:
                    self._cache.move_to_end(size)
                return parts[0] if len(parts) == 1 else torch.cat(parts)
        # Entries are built outside inference mode, so that later no-grad calls can use them.
        with torch.inference_mode(False), torch.no_grad():
            out = self._resample(taps, tap_weights)
            if len(out) <= self.cache_patches:
                rows = [r.clone() for r in out.split([h * w for h, w in sizes])]
                with self._lock:
                    if key == self._cache_key:
                        self._store(dict(zip(sizes, rows)))
        return out

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cache_key = None

    def _resample(self, taps: torch.Tensor, tap_weights: torch.Tensor) -> torch.Tensor:
        compute_dtype = torch.promote_types(self.weight.dtype, torch.float32)
        table = self.weight.flatten(0, 1).to(compute_dtype)
        out = F.embedding_bag(taps, table, per_sample_weights=tap_weights.to(compute_dtype), mode="sum")
        return out.to(self.weight.dtype)

    def _cache_key_now(self, sizes: Sequence[tuple[int, int]] | None) -> tuple | None:
        """The weight's identity now, or None when the cache must not be used for this call."""
        if not sizes or self.cache_patches <= 0:
            return None
        return table_cache_key(self.weight)

    def _store(self, entries: dict[tuple[int, int], torch.Tensor]) -> None:
        """Insert one pack's sizes, evicting the least recently used others to make room."""
        self._cache.update(entries)
        for size in entries:
            self._cache.move_to_end(size)
        while sum(len(r) for r in self._cache.values()) > self.cache_patches:
            self._cache.popitem(last=False)

    def __getstate__(self) -> dict:  # copies and pickles carry no cache (and no lock)
        state = dict(self.__dict__)
        state.update(_cache=OrderedDict(), _cache_key=None)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._lock = threading.Lock()

    def _apply(self, fn, recurse: bool = True):
        self.clear_cache()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self.clear_cache()
        super()._load_from_state_dict(*args, **kwargs)
