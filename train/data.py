"""The run's images: the dataset's train split cut into a training part and a validation part, and
its test split, each as an :class:`~train.batch.ImageSource`.

Validation (a seeded stratified share of train) is what any choice during training may look at;
the test split is scored once, after training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from eval.datasets import DatasetError, load_dataset
from eval.splits import stratified_split
from moonvit import MoonViTImageProcessor

from .batch import ImageSource

__all__ = ["DataError", "TrainingData", "load_training_data"]


class DataError(ValueError):
    """The data cannot be trained on: missing, empty, a single class."""


@dataclass(frozen=True)
class TrainingData:
    """Attributes:
    name: the ``--dataset`` spec.
    classes: class names, indexed by label.
    train, val, test: the training part of train, the validation part, the test split.
    fingerprint: sha256 of the train split's contents (resuming on other data is refused).
    """

    name: str
    classes: tuple[str, ...]
    train: ImageSource
    val: ImageSource
    test: ImageSource
    fingerprint: str


def _evenly(rows: np.ndarray, limit: int | None) -> np.ndarray:
    """At most ``limit`` of ``rows``, spread evenly over them (all of them without a limit)."""
    if limit is None or len(rows) <= limit:
        return rows
    return rows[np.linspace(0, len(rows) - 1, limit).round().astype(np.int64)]


def load_training_data(
    spec: str,
    data_dir: str | os.PathLike | None,
    val_fraction: float,
    seed: int,
    processor: MoonViTImageProcessor,
    eval_limit: int | None = None,
) -> TrainingData:
    """Load ``spec``'s splits and check that they can be trained on.

    Args:
        eval_limit: evaluate on at most this many validation and test images (``--smoke``).

    Raises:
        DataError: a bad spec or missing files, no training images, fewer than two classes.
    """
    try:
        dataset = load_dataset(spec, data_dir, seed=seed)
    except DatasetError as error:
        raise DataError(str(error)) from error
    labels = np.asarray(dataset.train.labels)
    if len(labels) == 0:
        raise DataError(f"{spec} has no training images")
    present = np.unique(labels)
    if len(present) < 2:
        name = dataset.classes[int(present[0])] if len(dataset.classes) > int(present[0]) else str(present[0])
        raise DataError(
            f"{spec} has a single class in its train split ({name!r}, {len(labels)} images): a classifier needs at "
            "least two"
        )
    train_rows, val_rows = stratified_split(labels, val_fraction, seed)
    if len(train_rows) == 0:
        raise DataError(f"{spec} has too few training images ({len(labels)}) to hold out a validation part")
    return TrainingData(
        spec,
        dataset.classes,
        ImageSource(dataset.train, processor, train_rows),
        ImageSource(dataset.train, processor, _evenly(val_rows, eval_limit)),
        ImageSource(dataset.test, processor, _evenly(np.arange(len(dataset.test)), eval_limit)),
        dataset.train.fingerprint(),
    )
