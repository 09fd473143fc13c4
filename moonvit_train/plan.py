"""The plan of a run: which images each step sees, at what size, keeping how many patches, in which pack.

Only sizes are planned here, never pixels, so every rank computes the same plan cheaply and
takes its own share of each step's packs (ranks can never disagree on the step count). The
plan's randomness is counter-based: epoch ``e`` draws its order, its sizes and each image's
seed from ``seed`` and ``e`` alone, so a plan restored from a checkpoint continues exactly.

- :class:`Resolution`: NaViT-style random resizing, aspect ratio kept.
- :class:`TokenDrop`: the share of each image's patches dropped, fixed or scheduled over the run.
- :class:`ImageStream`: the training images, epoch after epoch, each with its size, kept count
  and seed.
- :class:`Packer`: packs under a patch budget, filled from a look-ahead buffer (oldest image
  first, then the largest that fit), so that the budget is used to about 99% or more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ImageStream",
    "Packer",
    "PlannedPack",
    "PlannedTrainImage",
    "Resolution",
    "TokenDrop",
    "derive_seed",
    "eval_packs",
]


def derive_seed(*keys: int) -> int:
    """A 63-bit seed determined by ``keys`` (the run's seed, a purpose, a step, a pack, ...)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0] >> np.uint64(1))


@dataclass(frozen=True)
class Resolution:
    """Random resizing of each image: its short side drawn uniformly in ``[min_side, max_side]`` px.

    The long side follows the aspect ratio; both sides are then rounded to whole merge units
    (``patch_size * unit`` px, 28 by default) so the grid suits the 2x2 merger, and a grid over
    ``max_patches`` (the pack budget) or ``max_grid_side`` is scaled down, aspect kept.
    """

    min_side: int
    max_side: int
    max_patches: int
    patch_size: int = 14
    unit: int = 2
    max_grid_side: int = 512

    def __post_init__(self) -> None:
        if not 0 < self.min_side <= self.max_side:
            raise ValueError(f"resolution range must satisfy 0 < min <= max, got {self.min_side}-{self.max_side}")

    def grid(self, width: int, height: int, u: float = 1.0) -> tuple[int, int]:
        """(rows, cols) of a ``width`` x ``height`` image at the draw ``u`` in [0, 1) (1: the largest)."""
        side = self.min_side + u * (self.max_side - self.min_side)
        scale = side / min(width, height)
        step = self.patch_size * self.unit
        rows, cols = (max(1, round(n * scale / step)) for n in (height, width))
        if rows * cols * self.unit**2 > self.max_patches or max(rows, cols) * self.unit > self.max_grid_side:
            shrink = min(
                math.sqrt(self.max_patches / (rows * cols * self.unit**2)),
                self.max_grid_side / (max(rows, cols) * self.unit),
            )
            rows, cols = max(1, int(rows * shrink)), max(1, int(cols * shrink))
        return rows * self.unit, cols * self.unit

    def smallest_square(self) -> tuple[int, int]:
        """The grid of a square image at ``min_side``, before any cap: the least an image needs."""
        side = max(1, round(self.min_side / (self.patch_size * self.unit))) * self.unit
        return side, side


@dataclass(frozen=True)
class TokenDrop:
    """The share of each image's patches dropped before packing: ``start`` at the beginning of the
    run, moving linearly to ``end`` at its end (``start == end``: a fixed rate).

    Written ``RATE`` or ``START:END`` on the command line (``0.5``, ``0.6:0.2``).
    """

    start: float = 0.0
    end: float = 0.0

    def __post_init__(self) -> None:
        for rate in (self.start, self.end):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"token-drop rates must lie in [0, 1), got {rate}")

    @classmethod
    def parse(cls, text: str) -> TokenDrop:
        parts = text.split(":")
        try:
            rates = [float(part) for part in parts]
        except ValueError:
            raise ValueError(f"expected RATE or START:END, got {text!r}") from None
        if len(rates) not in (1, 2):
            raise ValueError(f"expected RATE or START:END, got {text!r}")
        return cls(rates[0], rates[-1])

    def __str__(self) -> str:
        return f"{self.start:g}" if self.start == self.end else f"{self.start:g}:{self.end:g}"

    @property
    def active(self) -> bool:
        return self.start > 0 or self.end > 0

    def rate(self, progress: float) -> float:
        """The rate at ``progress`` in [0, 1] of the run."""
        return self.start + (self.end - self.start) * min(max(progress, 0.0), 1.0)

    def kept(self, patches: int, progress: float) -> int:
        """Patches kept of an image of ``patches`` (at least one)."""
        return max(1, round(patches * (1.0 - self.rate(progress))))


@dataclass(frozen=True)
class PlannedTrainImage:
    """One training image of the plan.

    Attributes:
        index: its row in the training images.
        rows, cols: the patch grid it is resized to.
        kept: the patches fed to the encoder (``rows * cols`` without token dropping).
        seed: the seed of everything random about it when rendered (crop, augmentation, which
            patches are kept).
    """

    index: int
    rows: int
    cols: int
    kept: int
    seed: int

    @property
    def patches(self) -> int:
        return self.rows * self.cols


PlannedPack = tuple[PlannedTrainImage, ...]
"""Images fed to the encoder in one forward; their kept patches add up to at most the budget."""


class ImageStream:
    """The training images in a new seeded order every epoch, each drawn with its size, kept count and seed.

    Args:
        sizes: (N, 2) native (width, height) of each image.
        resolution: how images are resized.
        drop: the token-drop schedule.
        seed: the run's seed.
    """

    def __init__(self, sizes: np.ndarray, resolution: Resolution, drop: TokenDrop, seed: int) -> None:
        if len(sizes) == 0:
            raise ValueError("no training images")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.resolution = resolution
        self.drop = drop
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self.drawn = 0
        self._cached: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _epoch_draws(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order, size draws, seeds) of the current epoch, from (seed, epoch) alone."""
        if self._cached is None or self._cached[0] != self.epoch:
            rng = np.random.default_rng([self.seed, 0, self.epoch])
            count = len(self.sizes)
            order = rng.permutation(count)
            self._cached = (self.epoch, order, rng.random(count), rng.integers(0, 2**63 - 1, count))
        return self._cached[1:]

    def draw(self, progress: float) -> PlannedTrainImage:
        """The next image; ``progress`` in [0, 1] of the run sets its token-drop rate."""
        order, draws, seeds = self._epoch_draws()
        index = int(order[self.cursor])
        width, height = (int(n) for n in self.sizes[index])
        rows, cols = self.resolution.grid(width, height, float(draws[self.cursor]))
        image = PlannedTrainImage(index, rows, cols, self.drop.kept(rows * cols, progress), int(seeds[self.cursor]))
        self.cursor += 1
        self.drawn += 1
        if self.cursor == len(self.sizes):
            self.epoch, self.cursor = self.epoch + 1, 0
        return image

    @property
    def epochs_drawn(self) -> float:
        """Passes over the training images drawn so far (fractional)."""
        return self.drawn / len(self.sizes)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor, self.drawn = state["epoch"], state["cursor"], state["drawn"]


class Packer:
    """Packs of at most ``budget`` kept patches, filled from a look-ahead buffer of ``lookahead`` images.

    Each pack takes the oldest image of the buffer first (so no image waits long), then, largest
    first, every buffered image that still fits, then newly drawn images while they fit; the pack
    is then ordered by kept length (stably), so equal lengths are consecutive.
    """

    def __init__(self, stream: ImageStream, budget: int, lookahead: int) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be at least 1, got {lookahead}")
        self.stream = stream
        self.budget = budget
        self.lookahead = lookahead
        self.buffer: list[PlannedTrainImage] = []

    def next_pack(self, progress: float) -> PlannedPack:
        """The next pack; images drawn now get the token-drop rate at ``progress``."""
        while len(self.buffer) < self.lookahead:
            self.buffer.append(self.stream.draw(progress))
        first = self.buffer[0]
        if first.kept > self.budget:
            raise ValueError(f"an image keeps {first.kept} patches, over the pack budget of {self.budget}")
        chosen = [0]
        free = self.budget - first.kept
        by_size = sorted(range(1, len(self.buffer)), key=lambda i: -self.buffer[i].kept)
        smallest = self.buffer[by_size[-1]].kept if by_size else 0
        for i in by_size:
            if free < smallest:
                break
            if self.buffer[i].kept <= free:
                chosen.append(i)
                free -= self.buffer[i].kept
        taken = set(chosen)
        pack = [self.buffer[i] for i in sorted(chosen)]
        self.buffer = [image for i, image in enumerate(self.buffer) if i not in taken]
        # A pack may hold more images than the buffer: keep drawing until it is full, or until
        # ``lookahead`` images in a row did not fit (they wait in the buffer).
        misses = 0
        while free > 0 and misses < self.lookahead:
            image = self.stream.draw(progress)
            if image.kept <= free:
                pack.append(image)
                free -= image.kept
                misses = 0
            else:
                self.buffer.append(image)
                misses += 1
        # Images of one length side by side: the attention then reads each length's rows as one
        # view (one batched call, no gather). The sort is stable, so the order stays deterministic.
        return tuple(sorted(pack, key=lambda image: (image.kept, image.rows, image.cols)))

    def state_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream.state_dict(),
            "buffer": [(b.index, b.rows, b.cols, b.kept, b.seed) for b in self.buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.buffer = [PlannedTrainImage(*map(int, entry)) for entry in state["buffer"]]


def default_lookahead(budget: int, typical_kept: float) -> int:
    """About three packs' worth of images (at least 32, at most 4096)."""
    return int(min(4096, max(32, 3 * budget / max(typical_kept, 1.0))))


def eval_packs(grids: Sequence[tuple[int, int]], budget: int) -> list[list[int]]:
    """Consecutive runs of image indices whose full grids add up to at most ``budget`` patches each."""
    packs: list[list[int]] = []
    total = budget + 1
    for index, (rows, cols) in enumerate(grids):
        if total + rows * cols > budget:
            packs.append([])
            total = 0
        packs[-1].append(index)
        total += rows * cols
    return packs
