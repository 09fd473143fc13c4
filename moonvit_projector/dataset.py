"""Read the visual tokens written by ``python -m moonvit_projector.export``, one image at a time."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from .token_folder import MANIFEST_FILE, RUN_FILE

__all__ = ["VisualTokenDataset", "collate_visual_tokens"]

CHUNK_KEYS = ("video_id", "chunk", "timestamp", "frames", "frame_indices")
"""What a video chunk's item holds beside an image's keys (from its manifest line)."""
METADATA_KEYS = frozenset({"id", "grid_hw", "grid_thw", *CHUNK_KEYS})
"""An item's keys that are not stored tokens."""


class VisualTokenDataset(Dataset):
    """The images of an export folder, in manifest (input) order.

    ``dataset[i]`` (or ``dataset.by_id(id)``) is a dict with ``id``, ``grid_hw`` (rows, cols),
    ``grid_thw`` (frames, rows, cols) and each stored kind: ``projected`` (n, llm_hidden) and / or
    ``merged`` (n, 4, D), in the export dtype, n = rows * cols / 4. A video's chunk (id
    ``<video id>#<chunk>``) also has ``video_id``, ``chunk``, ``timestamp`` (seconds of its first
    frame, what ``moonvit_projector.video_prompt`` takes), ``frames`` and ``frame_indices``; an image has
    none of these keys. Only the image's rows are read from its shard
    (``safe_open(...).get_slice``), and the item owns just those rows. Shards are opened on
    first use in each process and open handles are not pickled, so the dataset works with
    DataLoader workers; ``DataLoader(dataset, batch_size=B, collate_fn=collate_visual_tokens)``
    packs each batch's variable-length token sets back to back.

    Args:
        folder: an export's ``--out`` folder, with ``run.json`` and ``manifest.jsonl``.
        kinds: the stored kinds to read (default: all that the export stored).

    Raises:
        FileNotFoundError: the folder lacks ``run.json`` or ``manifest.jsonl`` (an unfinished export).
        ValueError: ``kinds`` names a kind the export did not store.
    """

    def __init__(self, folder: str | Path, kinds: tuple[str, ...] | list[str] | None = None) -> None:
        self.folder = Path(folder)
        for name in (RUN_FILE, MANIFEST_FILE):
            if not (self.folder / name).is_file():
                raise FileNotFoundError(f"{self.folder} has no {name}: not a finished projector.export folder")
        self.run: dict[str, Any] = json.loads((self.folder / RUN_FILE).read_text())
        stored = tuple(self.run["store"])
        self.kinds = stored if kinds is None else tuple(kinds)
        unknown = sorted(set(self.kinds) - set(stored))
        if unknown:
            raise ValueError(f"{self.folder} stores {list(stored)}, not {unknown}")
        lines = (self.folder / MANIFEST_FILE).read_text().splitlines()
        self.records: list[dict[str, Any]] = [json.loads(line) for line in lines if line]
        self._positions = {record["id"]: i for i, record in enumerate(self.records)}
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.records)

    @property
    def ids(self) -> list[str]:
        return [record["id"] for record in self.records]

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.records[index]
        start, count = record["offset"], record["num_tokens"]
        shard = self._open(record["shard"])
        grid_hw = tuple(record["grid_hw"])
        item: dict[str, Any] = {"id": record["id"], "grid_hw": grid_hw, "grid_thw": (record.get("frames", 1), *grid_hw)}
        for key in CHUNK_KEYS:
            if key in record:
                item[key] = tuple(record[key]) if key == "frame_indices" else record[key]
        for kind in self.kinds:
            # The slice may view the shard's whole (memory-mapped) tensor: copy out the image's
            # rows, so that the item owns only them (and a worker sends only them to the loader).
            item[kind] = shard.get_slice(kind)[start : start + count].clone()
        return item

    def by_id(self, image_id: str) -> dict[str, Any]:
        """The item of the image with id ``image_id``; KeyError if the export has none."""
        if image_id not in self._positions:
            raise KeyError(f"no image with id {image_id!r} in {self.folder / MANIFEST_FILE}")
        return self[self._positions[image_id]]

    def _open(self, shard: str) -> Any:
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.folder / shard, framework="pt")
        return self._handles[shard]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}


def collate_visual_tokens(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A DataLoader ``collate_fn`` for :class:`VisualTokenDataset`: the items' token sets packed
    back to back (no padding), as the encoder and ``splice_visual_tokens`` lay them out.

    Returns:
        ``ids`` (list of B ids), ``grid_hws`` (B, 2) int64, ``grid_thws`` (B, 3) int64 (frames,
        rows, cols), ``timestamps`` (list of B seconds, None for images), ``num_tokens`` (B,) int64 (n_i), and
        for each stored kind the items' tokens concatenated in batch order: ``projected``
        (sum n_i, llm_hidden) and / or ``merged`` (sum n_i, 4, D).
        ``batch[kind].split(batch["num_tokens"].tolist())`` gives the items' tokens back.

    Raises:
        ValueError: no items, items without tokens or holding different kinds, or tokens of
            different trailing shapes or dtypes for one kind (items of different exports).
    """
    if not items:
        raise ValueError("collate_visual_tokens got no items")
    kinds = [key for key in items[0] if key not in METADATA_KEYS]
    if not kinds:
        raise ValueError("the items hold no tokens (a VisualTokenDataset made with kinds=())")
    for item in items:
        other = sorted(key for key in item if key not in METADATA_KEYS)
        if other != sorted(kinds):
            raise ValueError(f"item {item.get('id')!r} holds {other}, the batch's first item {sorted(kinds)}")
    batch: dict[str, Any] = {
        "ids": [item["id"] for item in items],
        "grid_hws": torch.tensor([list(item["grid_hw"]) for item in items], dtype=torch.int64).reshape(-1, 2),
        "grid_thws": torch.tensor(
            [list(item.get("grid_thw", (1, *item["grid_hw"]))) for item in items], dtype=torch.int64
        ).reshape(-1, 3),
        "timestamps": [item.get("timestamp") for item in items],
        "num_tokens": torch.tensor([len(item[kinds[0]]) for item in items], dtype=torch.int64),
    }
    for kind in kinds:
        layouts = {(tuple(item[kind].shape[1:]), item[kind].dtype) for item in items}
        if len(layouts) > 1:
            raise ValueError(
                f"the batch's {kind} tokens differ in (trailing shape, dtype): {sorted(map(str, layouts))}"
            )
        batch[kind] = torch.cat([item[kind] for item in items])
    return batch
