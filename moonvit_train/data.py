"""The run's images: the dataset's train split cut into a training part and a validation part, and
its test split, each as an :class:`~train.batch.ImageSource`; or, for a self-supervised objective,
a folder of unlabelled images (``images:DIR``) cut into a training and a validation part.

Validation (a seeded stratified share of train) is what any choice during training may look at;
the test split is scored once, after training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moonvit import ImageLoadError, MoonViTImageProcessor, image_size
from moonvit.media.image import images_below
from moonvit.names import path_record
from moonvit_eval.datasets import DatasetError, Split, load_dataset
from moonvit_eval.probe import check_probe_labels
from moonvit_eval.splits import stratified_split

from .batch import ImageSource

__all__ = ["UNLABELLED_PREFIX", "DataError", "SkippedImage", "TrainingData", "load_training_data", "readable_images"]


class DataError(ValueError):
    """The data cannot be trained on: missing, empty, a single class, an unreadable image."""


@dataclass(frozen=True)
class SkippedImage:
    """An image left out by ``--skip-bad-images``: its file, its split and why it could not be read."""

    path: str
    split: str
    reason: str

    def record(self) -> dict[str, str]:
        """Its ``results.json`` entry: the path as :func:`~moonvit.names.path_record` writes it
        (escaped, with its bytes beside it, when the name is not UTF-8), the split, the reason."""
        return {**path_record(self.path), "split": self.split, "reason": self.reason}


@dataclass(frozen=True)
class TrainingData:
    """Attributes:
    name: the ``--dataset`` spec.
    classes: class names, indexed by label.
    train, val, test: the training part of train, the validation part, the test split (None for
        ``images:DIR``, which has none).
    fingerprint: sha256 of the train split's contents (resuming on other data is refused).
    warnings: what a user should hear of the data (class folders with no image, classes with one
        training image); printed once and recorded in ``results.json``.
    skipped: the unreadable images left out (``--skip-bad-images``).
    """

    name: str
    classes: tuple[str, ...]
    train: ImageSource
    val: ImageSource
    test: ImageSource | None
    fingerprint: str
    warnings: tuple[str, ...] = ()
    skipped: tuple[SkippedImage, ...] = ()


def _evenly(rows: np.ndarray, limit: int | None) -> np.ndarray:
    """At most ``limit`` of ``rows``, spread evenly over them (all of them without a limit)."""
    if limit is None or len(rows) <= limit:
        return rows
    return rows[np.linspace(0, len(rows) - 1, limit).round().astype(np.int64)]


def readable_images(
    split: Split, name: str, processor: MoonViTImageProcessor, skip_bad: bool, progress: bool = False
) -> tuple[Split, np.ndarray | None, list[SkippedImage]]:
    """The images of a split that can be read, their (width, height) and the ones left out.

    Every file's header is read (the plan needs its size). With ``skip_bad`` every file is also
    decoded once, as training will decode it, and the files that fail either way are left out;
    without it the first unreadable header is an error (a file that only fails to decode is then
    an error when training reaches it). Arrays are taken as they are (sizes None).

    Raises:
        DataError: without ``skip_bad``, a file whose header cannot be read; with it, a split left
            with no image.
    """
    if isinstance(split.images, np.ndarray):
        return split, None, []
    kept, sizes, skipped = [], [], []
    paths = list(split.images)
    what = "checking" if skip_bad else "reading the headers of"
    for row, path in enumerate(tqdm(paths, desc=f"{what} the {name} images", unit="image", disable=not progress)):
        try:
            size = image_size(path)
            if skip_bad:
                processor.load_image(path)
        except (ImageLoadError, OSError) as error:
            if not skip_bad:
                raise DataError(
                    f"{name} image {path} cannot be read ({error}); --skip-bad-images checks every image before "
                    "training and leaves out the ones that fail (listed in results.json)"
                ) from error
            skipped.append(SkippedImage(str(path), name, str(error)))
            continue
        kept.append(row)
        sizes.append(size)
    if not kept:
        raise DataError(f"no {name} image can be read ({len(skipped)} skipped; the first: {skipped[0].reason})")
    rows = np.asarray(kept, dtype=np.int64)
    return Split([paths[i] for i in rows], split.labels[rows]), np.asarray(sizes, dtype=np.int64), skipped


def load_training_data(
    spec: str,
    data_dir: str | os.PathLike | None,
    val_fraction: float,
    seed: int,
    processor: MoonViTImageProcessor,
    eval_limit: int | None = None,
    skip_bad: bool = False,
    progress: bool = False,
    labelled: bool = True,
) -> TrainingData:
    """Load ``spec``'s splits and check that they can be trained on.

    Args:
        spec: a labelled dataset (``fashion-mnist``, ``digits``, ``imagefolder:DIR``) or
            ``images:DIR``, every image below DIR with no labels (no test split).
        eval_limit: evaluate on at most this many validation and test images (``--smoke``).
        skip_bad: decode every image once and leave out those that fail (see :func:`readable_images`).
        progress: a progress bar over the image files.
        labelled: whether the objective learns from labels (two classes at least); a self-supervised
            one takes any data, labels or not.

    Raises:
        DataError: a bad spec or missing files, no training images, fewer than two classes (for a
            labelled objective), an unreadable image (without ``skip_bad``).
    """
    if spec.startswith(UNLABELLED_PREFIX):
        if labelled:
            raise DataError(
                f"{spec} has no labels, and this objective learns from them: give a labelled dataset "
                "(imagefolder:DIR, one folder per class), or train a self-supervised objective (--objective mae)"
            )
        train_split = _unlabelled(Path(spec.removeprefix(UNLABELLED_PREFIX)))
        test_split: Split | None = None
        classes: tuple[str, ...] = ()
        notes: tuple[str, ...] = ()
    else:
        try:
            dataset = load_dataset(spec, data_dir, seed=seed)
        except DatasetError as error:
            raise DataError(str(error)) from error
        train_split, test_split, classes, notes = dataset.train, dataset.test, dataset.classes, dataset.notes
    fingerprint = train_split.fingerprint()
    train, train_sizes, skipped = readable_images(train_split, "train", processor, skip_bad, progress)
    labels = np.asarray(train.labels)
    if len(labels) < 2:
        raise DataError(f"{spec} has {len(labels)} training images; training needs at least 2")
    label_warnings: list[str] = []
    if labelled:
        try:
            label_warnings = check_probe_labels(
                labels, None, classes, val_fraction, seed, held_out="validation", user="a classifier"
            )
        except ValueError as error:
            raise DataError(f"{spec}: {error}") from error
    train_rows, val_rows = stratified_split(labels, val_fraction, seed)
    if len(train_rows) == 0 or len(val_rows) == 0:
        raise DataError(f"{spec} has too few training images ({len(labels)}) to hold out a validation part")
    test = None
    if test_split is not None:
        readable, test_sizes, skipped_test = readable_images(test_split, "test", processor, skip_bad, progress)
        skipped += skipped_test
        test = ImageSource(readable, processor, _evenly(np.arange(len(readable)), eval_limit), test_sizes)
    return TrainingData(
        spec,
        tuple(classes),
        ImageSource(train, processor, train_rows, train_sizes),
        ImageSource(train, processor, _evenly(val_rows, eval_limit), train_sizes),
        test,
        fingerprint,
        (*notes, *label_warnings),
        tuple(skipped),
    )


UNLABELLED_PREFIX = "images:"
"""``--dataset images:DIR``: every image below DIR, recursively, with no labels."""


def _unlabelled(folder: Path) -> Split:
    """Every image file below ``folder`` as a split of one (meaningless) label."""
    try:
        files = images_below(folder)
    except ValueError as error:
        raise DataError(str(error)) from error
    return Split(files, np.zeros(len(files), dtype=np.int64))
