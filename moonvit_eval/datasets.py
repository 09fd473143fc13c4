"""Labelled image datasets as train / test splits: Fashion-MNIST, digits and ImageFolder trees.

``--dataset`` specs (see :func:`load_dataset`):
    ``fashion-mnist``: the four standard IDX files (gzip or not) in ``data_dir``, by default
        where Debian's ``dataset-fashion-mnist`` package puts them. 60000 train, 10000 test.
    ``digits``: scikit-learn's bundled 8x8 digits (1797 images, values 0-16, scaled to 0-255 as
        ``round(v * 255 / 16)``); a seeded stratified 20% of each class is the test split.
    ``imagefolder:DIR``: one subfolder per class. When ``DIR`` has a ``train`` folder, that is the
        train split and ``test`` (else ``val``) the test split; otherwise a seeded stratified 20%
        of each class is the test split.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moonvit.files import files_below, folder_problem
from moonvit.media.image import IMAGE_EXTENSIONS
from moonvit.names import display_name, text_bytes

from .splits import stratified_split

__all__ = ["DEFAULT_FASHION_MNIST_DIR", "Dataset", "DatasetError", "Split", "load_dataset", "read_idx"]

DEFAULT_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs the IDX files."""

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
TEST_FRACTION = 0.2
_IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class DatasetError(ValueError):
    """A dataset cannot be loaded: a bad spec, missing or malformed files."""


@dataclass(frozen=True)
class Split:
    """N labelled images.

    Attributes:
        images: (N, H, W) uint8 grayscale array, or N image file paths.
        labels: (N,) int64 class indices.
    """

    images: np.ndarray | Sequence[Path]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def fingerprint(self) -> str:
        """sha256 of the labels and the images' bytes (files: paths, sizes, mtimes)."""
        digest = hashlib.sha256(np.ascontiguousarray(self.labels, dtype=np.int64).tobytes())
        if isinstance(self.images, np.ndarray):
            digest.update(repr((self.images.dtype.str, self.images.shape)).encode())
            digest.update(np.ascontiguousarray(self.images).tobytes())
        else:
            for path in self.images:
                stat = os.stat(path)
                digest.update(text_bytes(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n"))  # any file name
        return digest.hexdigest()


@dataclass(frozen=True)
class Dataset:
    """A train and a test split over the same classes.

    Attributes:
        name: the ``--dataset`` spec it was loaded from.
        classes: class names, indexed by label.
        train, test: the splits.
        split_rule: how the test split was made, for the results.
        notes: what loading left out that a user should hear of (class folders with no image).
    """

    name: str
    classes: tuple[str, ...]
    train: Split
    test: Split
    split_rule: str
    notes: tuple[str, ...] = ()


def load_dataset(spec: str, data_dir: str | os.PathLike | None = None, seed: int = 0) -> Dataset:
    """Load the dataset named by a ``--dataset`` spec (see the module docstring).

    Args:
        spec: ``fashion-mnist``, ``digits`` or ``imagefolder:DIR``.
        data_dir: Fashion-MNIST's folder (default :data:`DEFAULT_FASHION_MNIST_DIR`); ignored otherwise.
        seed: seed of the stratified test split where the dataset has none.

    Raises:
        DatasetError: unknown spec, missing files or folders, malformed IDX files.
    """
    if spec == "fashion-mnist":
        return _fashion_mnist(Path(data_dir) if data_dir is not None else DEFAULT_FASHION_MNIST_DIR)
    if spec == "digits":
        return _digits(seed)
    if spec.startswith("imagefolder:") and spec != "imagefolder:":
        return _image_folder(spec, Path(spec.removeprefix("imagefolder:")), seed)
    raise DatasetError(f"unknown --dataset {spec!r}; expected 'fashion-mnist', 'digits' or 'imagefolder:DIR'")


# ---- Fashion-MNIST ----------------------------------------------------------------------------


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (gzip-compressed or not) into an array of its declared shape and dtype."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_DTYPES:
        raise DatasetError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype: np.dtype = np.dtype(_IDX_DTYPES[raw[2]])  # type: ignore[call-overload]
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise DatasetError(f"{path}: header declares shape {shape} ({expected} bytes) but the file has {len(raw)}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def _find_idx(folder: Path, stem: str) -> Path:
    for name in (stem, f"{stem}.gz"):
        if (folder / name).is_file():
            return folder / name
    raise DatasetError(
        f"Fashion-MNIST file {stem}[.gz] not found in {folder}; install Debian's dataset-fashion-mnist "
        f"package (files in {DEFAULT_FASHION_MNIST_DIR}) or pass --data-dir to a folder holding "
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte"
    )


def _idx_split(folder: Path, prefix: str) -> Split:
    images = read_idx(_find_idx(folder, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(_find_idx(folder, f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
    if images.ndim != 3 or images.dtype != np.uint8 or labels.shape != images.shape[:1]:
        raise DatasetError(f"{folder}: {prefix} images {images.shape} and labels {labels.shape} do not match")
    return Split(images, labels)


def _fashion_mnist(folder: Path) -> Dataset:
    problem = folder_problem(folder)
    if problem is not None:
        raise DatasetError(
            f"Fashion-MNIST folder {folder} {problem}; install Debian's dataset-fashion-mnist package "
            "or pass --data-dir"
        )
    return Dataset(
        "fashion-mnist",
        FASHION_MNIST_CLASSES,
        _idx_split(folder, "train"),
        _idx_split(folder, "t10k"),
        "the official 60000 / 10000 train / test files",
    )


# ---- digits -----------------------------------------------------------------------------------


def _digits(seed: int) -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    train, test = stratified_split(labels, TEST_FRACTION, seed)
    return Dataset(
        "digits",
        tuple(str(n) for n in range(10)),
        Split(images[train], labels[train]),
        Split(images[test], labels[test]),
        f"seeded stratified {TEST_FRACTION:.0%} test split (seed {seed})",
    )


# ---- ImageFolder ------------------------------------------------------------------------------


def _class_files(folder: Path) -> tuple[dict[str, list[Path]], list[str]]:
    """{class name: sorted image files} for every subfolder of ``folder`` holding images, and the
    names of the subfolders holding none (left out: a class with no image cannot be learnt)."""
    problem = folder_problem(folder)
    if problem is not None:
        raise DatasetError(f"image folder {folder} {problem}")
    classes, empty = {}, []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        files, _ = files_below(sub, IMAGE_EXTENSIONS)
        if files:
            classes[display_name(sub.name)] = files  # a class name is text of reports and pictures
        else:
            empty.append(display_name(sub.name))
    if not classes:
        raise DatasetError(f"image folder {folder} has no class subfolders with images ({sorted(IMAGE_EXTENSIONS)})")
    return classes, empty


def _empty_note(folder: Path, empty: Sequence[str]) -> tuple[str, ...]:
    if not empty:
        return ()
    shown = ", ".join(repr(name) for name in empty[:8]) + (f" and {len(empty) - 8} more" if len(empty) > 8 else "")
    return (f"class folders of {folder} with no image ({sorted(IMAGE_EXTENSIONS)}) are left out: {shown}",)


def _to_split(files: dict[str, list[Path]], classes: Sequence[str]) -> Split:
    index = {name: i for i, name in enumerate(classes)}
    paths = [path for name in files for path in files[name]]
    labels = np.array([index[name] for name in files for _ in files[name]], dtype=np.int64)
    return Split(paths, labels)


def _image_folder(spec: str, root: Path, seed: int) -> Dataset:
    spec = display_name(spec)  # the name of progress bars, titles and records: a path that may not be UTF-8
    if (root / "train").is_dir():
        test_dir = next((root / name for name in ("test", "val") if (root / name).is_dir()), None)
        if test_dir is None:
            raise DatasetError(f"{root} has a train folder but neither test nor val")
        (train_files, train_empty), (test_files, test_empty) = _class_files(root / "train"), _class_files(test_dir)
        unknown = sorted(set(test_files) - set(train_files))
        if unknown:
            raise DatasetError(f"{test_dir} has classes missing from {root / 'train'}: {unknown}")
        classes = tuple(train_files)
        return Dataset(
            spec,
            classes,
            _to_split(train_files, classes),
            _to_split(test_files, classes),
            f"the folder's own train / {test_dir.name} splits",
            _empty_note(root / "train", train_empty) + _empty_note(test_dir, test_empty),
        )
    files, empty = _class_files(root)
    classes = tuple(files)
    everything = _to_split(files, classes)
    train, test = stratified_split(everything.labels, TEST_FRACTION, seed)
    paths = list(everything.images)
    return Dataset(
        spec,
        classes,
        Split([paths[i] for i in train], everything.labels[train]),
        Split([paths[i] for i in test], everything.labels[test]),
        f"seeded stratified {TEST_FRACTION:.0%} test split (seed {seed})",
        _empty_note(root, empty),
    )
