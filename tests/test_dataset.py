"""VisualTokenDataset: per-image reads of an export folder, by index and by id, in DataLoader workers."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from helpers import make_checkpoint, run_export, write_images
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from moonvit_projector.dataset import VisualTokenDataset, collate_visual_tokens


@pytest.fixture(scope="module")
def export_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    write_images(root / "images", 7, seed=2)
    run_export(
        "--inputs",
        root / "images",
        "--checkpoint",
        make_checkpoint(root / "ckpt"),
        "--out",
        root / "out",
        "--store",
        "both",
        "--shard-size",
        "3",
    )
    return root / "out"


def expected_items(folder: Path) -> list[dict]:
    """Each manifest line's rows, cut from whole shards loaded with safetensors.torch.load_file."""
    items = []
    for line in map(json.loads, (folder / "manifest.jsonl").read_text().splitlines()):
        shard = load_file(folder / line["shard"])
        rows = slice(line["offset"], line["offset"] + line["num_tokens"])
        items.append(
            {
                "id": line["id"],
                "grid_hw": tuple(line["grid_hw"]),
                "grid_thw": (1, *line["grid_hw"]),
                "merged": shard["merged"][rows],
                "projected": shard["projected"][rows],
            }
        )
    return items


def assert_items_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    assert (actual["id"], actual["grid_hw"]) == (expected["id"], expected["grid_hw"])
    for kind in ("merged", "projected"):
        torch.testing.assert_close(actual[kind], expected[kind], rtol=0, atol=0)


def test_items_are_each_images_rows_in_manifest_order(export_folder):
    dataset = VisualTokenDataset(export_folder)
    expected = expected_items(export_folder)
    assert len(dataset) == 7 and dataset.ids == [item["id"] for item in expected]
    for i, item in enumerate(expected):
        actual = dataset[i]
        assert_items_equal(actual, item)
        rows, cols = actual["grid_hw"]
        assert actual["merged"].shape == (rows * cols // 4, 4, 64)
        assert actual["projected"].shape == (rows * cols // 4, 32)
        assert actual["projected"].dtype == torch.bfloat16
        # Only this image's rows were read, not the whole shard.
        assert actual["projected"].untyped_storage().nbytes() == actual["projected"].numel() * 2


def test_lookup_by_id(export_folder):
    dataset = VisualTokenDataset(export_folder)
    expected = expected_items(export_folder)[4]
    assert_items_equal(dataset.by_id(expected["id"]), expected)
    with pytest.raises(KeyError, match="no image with id 'missing.png'"):
        dataset.by_id("missing.png")


def test_kinds_select_the_tensors_read(export_folder):
    item = VisualTokenDataset(export_folder, kinds=["projected"])[0]
    assert set(item) == {"id", "grid_hw", "grid_thw", "projected"}
    with pytest.raises(ValueError, match=r"stores \['merged', 'projected'\], not \['hidden'\]"):
        VisualTokenDataset(export_folder, kinds=["hidden"])


def test_works_in_dataloader_workers_after_use_in_the_parent(export_folder):
    dataset = VisualTokenDataset(export_folder)
    dataset[0]  # opens a shard here; the handle must not travel to the workers
    clone = pickle.loads(pickle.dumps(dataset))
    assert_items_equal(clone[1], dataset[1])
    loader = DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=list)
    loaded = [item for batch in loader for item in batch]
    for actual, expected in zip(loaded, expected_items(export_folder), strict=True):
        assert_items_equal(actual, expected)


def test_an_unfinished_export_folder_is_refused(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="has no manifest.jsonl: not a finished projector.export folder"):
        VisualTokenDataset(tmp_path)


# ---- batches ---------------------------------------------------------------------------------


def test_collate_packs_variable_length_token_sets_with_their_counts(export_folder):
    dataset = VisualTokenDataset(export_folder)
    expected = expected_items(export_folder)
    loader = DataLoader(dataset, batch_size=3, collate_fn=collate_visual_tokens)
    seen = 0
    for batch in loader:
        items = expected[seen : seen + 3]
        seen += len(items)
        assert batch["ids"] == [item["id"] for item in items]
        assert batch["grid_hws"].tolist() == [list(item["grid_hw"]) for item in items]
        assert batch["grid_thws"].tolist() == [[1, *item["grid_hw"]] for item in items]
        assert batch["timestamps"] == [None] * len(items)
        assert batch["num_tokens"].tolist() == [len(item["merged"]) for item in items]
        assert len({len(item["merged"]) for item in items}) > 1 or len(items) == 1  # the lengths do vary
        for kind in ("merged", "projected"):
            assert batch[kind].shape[0] == batch["num_tokens"].sum()
            for part, item in zip(batch[kind].split(batch["num_tokens"].tolist()), items):
                torch.testing.assert_close(part, item[kind], rtol=0, atol=0)
    assert seen == len(dataset) == 7  # the last batch is short


def test_collate_refuses_what_it_cannot_pack(export_folder):
    dataset = VisualTokenDataset(export_folder)
    merged_only = VisualTokenDataset(export_folder, kinds=["merged"])
    with pytest.raises(ValueError, match="no items"):
        collate_visual_tokens([])
    with pytest.raises(ValueError, match=r"holds \['merged'\], the batch's first item \['merged', 'projected'\]"):
        collate_visual_tokens([dataset[0], merged_only[1]])
    other = {**dataset[1], "merged": dataset[1]["merged"][..., :8]}
    with pytest.raises(ValueError, match="merged tokens differ in"):
        collate_visual_tokens([dataset[0], other])
    with pytest.raises(ValueError, match="hold no tokens"):
        collate_visual_tokens([VisualTokenDataset(export_folder, kinds=[])[0]])
