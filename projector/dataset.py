"""Read the visual tokens written by ``python -m projector.export``, one image at a time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch.utils.data import Dataset

from .token_folder import MANIFEST_FILE, RUN_FILE

__all__ = ["VisualTokenDataset"]


class VisualTokenDataset(Dataset):
    """The images of an export folder, in manifest (input) order.

    ``dataset[i]`` (or ``dataset.by_id(id)``) is a dict with ``id``, ``grid_hw`` (rows, cols) and
    each stored kind: ``projected`` (n, llm_hidden) and / or ``merged`` (n, 4, D), in the export
    dtype, n = rows * cols / 4. Only the image's rows are read from its shard
    (``safe_open(...).get_slice``), and the item owns just those rows. Shards are opened on
    first use in each process and open handles are not pickled, so the dataset works with
    DataLoader workers.

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
        item: dict[str, Any] = {"id": record["id"], "grid_hw": tuple(record["grid_hw"])}
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
