"""Planning from file headers alone: each input's pack items, the shards, and the ranks' shares."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from moonvit import PackItem
from moonvit.distributed import Ranks
from moonvit.files import sha256_file
from moonvit.media.image import PinnedFile
from moonvit.media.packing import plan_pack_item, plan_video_items
from moonvit.media.video import is_video

from .inputs import InputImage
from .models import Models
from .settings import ExportError

__all__ = ["ExportItem", "plan_all", "plan_input", "shard_ranges", "split_balanced"]


@dataclass(frozen=True)
class ExportItem:
    """An input and its items (one for an image, one per chunk for a video), planned from the
    file's header or container alone, or why it cannot be exported (then ``items`` is empty)."""

    image: InputImage
    items: tuple[PackItem, ...]
    reason: str | None
    sha256: str | None = None
    """The file's content hash (None when it could not be planned)."""

    @property
    def num_patches(self) -> int:
        return sum(item.num_patches for item in self.items)


def plan_input(index: int, image: InputImage, models: Models, budget: int) -> ExportItem:
    """Plan one input from its header alone (scaled down if alone it exceeds ``budget``), and
    hash its content (which finds the copies of an image: :func:`.cache.duplicate_sources`).

    An image's item reads a :class:`~moonvit.media.image.PinnedFile`: its pixels are decoded
    from the very bytes whose hash the manifest and the cache record (a file replaced after
    planning fails with its reason instead of being stored under the old content's hash)."""
    try:
        if is_video(image.path):
            models.video_processor.check_tower(models.encoder.config.max_frames)
            items = tuple(plan_video_items(index, image.path, models.video_processor, budget))
        else:
            items = (plan_pack_item(index, image.path, models.processor, budget),)
    except ValueError as error:  # ImageLoadError included; the cause is the unprefixed reason
        return ExportItem(image, (), str(error.__cause__ or error))
    try:
        sha256 = sha256_file(image.path)
    except OSError as error:  # the file went away after its header was read
        return ExportItem(image, (), str(error))
    if items[0].chunk is None:
        items = (dataclasses.replace(items[0], source=PinnedFile(image.path, sha256)),)
    return ExportItem(image, items, None, sha256)


def plan_all(images: Sequence[InputImage], models: Models, budget: int, ranks: Ranks) -> list[ExportItem]:
    """Plan every input, the header reads spread over the ranks; the same list on every rank.

    Raises:
        ExportError: no input can be planned (the commonest reasons given).
    """
    mine = {i: plan_input(i, images[i], models, budget) for i in range(ranks.rank, len(images), ranks.world_size)}
    merged: dict[int, ExportItem] = {}
    for part in ranks.all_gather(mine):
        merged.update(part)
    planned = [merged[i] for i in range(len(images))]
    if all(not entry.items for entry in planned):
        reasons = collections.Counter(str(entry.reason) for entry in planned).most_common(3)
        raise ExportError(
            f"none of the {len(planned)} inputs can be exported: "
            + "; ".join(f"{reason} ({count} images)" for reason, count in reasons)
        )
    return planned


def shard_ranges(count: int, shard_size: int) -> list[range]:
    """Input positions of each shard: consecutive runs of ``shard_size``."""
    return [range(start, min(start + shard_size, count)) for start in range(0, count, shard_size)]


def split_balanced(costs: Sequence[int], parts: int) -> list[range]:
    """Split ``costs`` into ``parts`` contiguous ranges with about equal sums (some may be empty)."""
    prefix = [0, *itertools.accumulate(costs)]
    starts = [bisect.bisect_left(prefix, prefix[-1] * r / parts) for r in range(parts)]
    return [range(start, end) for start, end in zip(starts, [*starts[1:], len(costs)])]
