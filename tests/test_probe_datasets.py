"""Datasets and splits of the linear probe: IDX files, ImageFolder trees, digits, bad specs."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from moonvit_eval.datasets import DatasetError, load_dataset, read_idx
from moonvit_eval.splits import stratified_split


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


def write_fashion_folder(folder: Path, compress: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (6, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(6) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (3, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(3),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        write_idx(folder / (f"{name}.gz" if compress else name), array, compress)
    return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_fashion_mnist_reads_idx_files_gzip_or_not(tmp_path, compress):
    arrays = write_fashion_folder(tmp_path, compress)
    dataset = load_dataset("fashion-mnist", tmp_path)
    np.testing.assert_array_equal(dataset.train.images, arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(dataset.test.labels, arrays["t10k-labels-idx1-ubyte"])
    assert dataset.train.images.dtype == np.uint8 and len(dataset.classes) == 10


def test_missing_fashion_mnist_file_is_named(tmp_path):
    write_fashion_folder(tmp_path, compress=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError, match="t10k-labels-idx1-ubyte.*dataset-fashion-mnist"):
        load_dataset("fashion-mnist", tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset("fashion-mnist", tmp_path / "nowhere")


def test_truncated_idx_file_is_refused(tmp_path):
    path = tmp_path / "x"
    write_idx(path, np.zeros((2, 3), dtype=np.uint8), compress=False)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DatasetError, match="header declares shape"):
        read_idx(path)


@pytest.mark.parametrize("spec", ["mnist", "imagefolder:", "imagefolder"])
def test_bad_dataset_spec(spec):
    with pytest.raises(DatasetError, match="unknown --dataset"):
        load_dataset(spec)


def write_class_tree(root: Path, counts: dict[str, int]) -> None:
    for name, count in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.new("RGB", (10 + i, 12), (i * 20 % 256, 0, 0)).save(root / name / f"{i}.png")


def test_imagefolder_uses_its_own_splits(tmp_path):
    write_class_tree(tmp_path / "train", {"cat": 3, "dog": 2})
    write_class_tree(tmp_path / "val", {"dog": 1})
    dataset = load_dataset(f"imagefolder:{tmp_path}")
    assert dataset.classes == ("cat", "dog")
    assert dataset.train.labels.tolist() == [0, 0, 0, 1, 1] and dataset.test.labels.tolist() == [1]
    assert "val" in dataset.split_rule


def test_imagefolder_seeded_split_and_errors(tmp_path):
    write_class_tree(tmp_path, {"a": 10, "b": 5})
    first, again = load_dataset(f"imagefolder:{tmp_path}", seed=3), load_dataset(f"imagefolder:{tmp_path}", seed=3)
    assert first.test.images == again.test.images
    assert sorted(first.test.labels.tolist()) == [0, 0, 1]  # 20% of each class
    with pytest.raises(DatasetError, match="no class subfolders"):
        load_dataset(f"imagefolder:{tmp_path / 'a'}")
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(f"imagefolder:{tmp_path / 'missing'}")


def test_digits_split_is_stratified_and_seeded():
    dataset = load_dataset("digits", seed=0)
    assert len(dataset.train) + len(dataset.test) == 1797
    assert dataset.train.images.dtype == np.uint8 and dataset.train.images.max() == 255
    counts = np.bincount(dataset.test.labels)
    assert counts.min() >= 35 and counts.max() <= 37
    np.testing.assert_array_equal(load_dataset("digits", seed=0).test.labels, dataset.test.labels)


def test_stratified_split_partitions_each_class():
    labels = np.repeat(np.arange(3), [10, 20, 30])
    kept, held = stratified_split(labels, 0.1, seed=0)
    assert np.bincount(labels[held]).tolist() == [1, 2, 3]
    assert sorted(np.concatenate([kept, held]).tolist()) == list(range(60))
    assert not np.array_equal(held, stratified_split(labels, 0.1, seed=1)[1])
