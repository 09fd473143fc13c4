"""DeiT's hard-label distillation (Touvron et al., 2021, §4 and §8.1) on packed native-resolution images.

The student is a DeiT tower: a classic ViT with a distillation token after the CLS token and two
linear heads, one on each (``head_logits`` (N, 2, C)). A frozen teacher classifier sees the same
images (every patch of each, in its own normalisation) and its argmax is the distillation head's
label:

    loss(image) = 0.5 * CE(head_logits[:, 0], label) + 0.5 * CE(head_logits[:, 1], argmax teacher(image))

the class head's cross-entropy taken as the supervised objective's (``--smoothing``, and Mixup /
CutMix's mixed labels where those are on: the teacher then labels the mixed image, as DeiT does),
the distillation head's against the teacher's hard label, unsmoothed. At inference the tower's
``logits`` are the mean of its two heads (what validation and the test split score).

The loss is a sum over the pack's images; the engine divides by the step's images over every rank.
The teacher is a classic ViT / DeiT folder with a head, or a supervised run's ``--out`` (its
``checkpoint/`` and the ``head.safetensors`` the trainer wrote beside it); its patches must be the
student's (the teacher runs on the student's packed patches). It is held outside the module tree, as
:mod:`~moonvit_train.objectives.distill`'s: not trained, not in the optimiser or the run's state,
loaded again from ``--teacher`` on resume (the run's identity records it).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from moonvit import CheckpointError, MoonViT, MoonViTImageProcessor, build_packed_grid
from moonvit.cli import checkpoint_source, drop_rate

from ..batch import Batch
from ..classic import ClassicViT, Encoder, fit_heads, freeze_unread, is_classic, processor_of
from ..plan import PlannedTrainImage
from .base import Objective, ObjectiveOutput
from .distill import TeacherError, _channel_stats
from .supervised import HEAD_FILE, SupervisedObjective, classification_report, soft_targets

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["DeiTObjective", "TeacherClassifier", "load_teacher_classifier"]

NOT_DEIT = (
    "--objective deit trains a DeiT tower (a classic ViT with a distillation token): --preset "
    "deit-base-distilled-16 or a DeiT folder (--checkpoint)"
)
DISTILL_WEIGHT = 0.5
"""DeiT's hard distillation: the two heads' losses weighted equally."""


@dataclass
class TeacherClassifier:
    """A frozen classifier: a tower and how its output becomes logits (its own head, or a trainer's head file).

    Attributes:
        tower: the tower, in eval mode, no gradient.
        head: the classification step (:meth:`SupervisedObjective.classify`), in eval mode.
        processor: its normalisation.
        classes: the class names its head file lists (empty where the folder names none).
        name: the folder's last part, for messages and results.json.
    """

    tower: Encoder
    head: SupervisedObjective
    processor: MoonViTImageProcessor
    classes: tuple[str, ...]
    name: str

    @property
    def num_classes(self) -> int:
        return len(self.head.classes)

    @torch.no_grad()
    def logits(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """(N, C) float32 logits of full images: ``pixel_values`` (L, C, p, p) in the teacher's normalisation,
        every patch of each image in raster order; ``grid_thws`` (N, 3) their grids."""
        if self.tower.device != pixel_values.device:
            self.tower.to(pixel_values.device)
            self.head.to(pixel_values.device)
        grid = build_packed_grid(grid_thws, self.tower.config, pixel_values.device)
        return self.head.classify(self.tower(pixel_values, grid=grid), grid)


def load_teacher_classifier(spec: str) -> TeacherClassifier:
    """The teacher of ``--teacher``: a tower folder with its own head (a classic ViT / DeiT classifier), or a
    supervised run's ``--out`` (``checkpoint/`` and ``head.safetensors`` beside it).

    Raises:
        TeacherError: no folder or tower there, or a tower without a classifier.
    """
    path = Path(spec)
    run_folder = (
        path.is_dir() and (path / "checkpoint" / "config.json").is_file() and not (path / "config.json").exists()
    )
    tower_path = path / "checkpoint" if run_folder else path
    try:
        tower = MoonViT.from_pretrained(tower_path, dtype=torch.float32)
        classic = is_classic(tower)
        processor = processor_of(tower, tower_path)
    except (CheckpointError, OSError, ValueError) as error:
        raise TeacherError(f"cannot load it: {error}") from error
    tower.eval().requires_grad_(False)
    width, name = tower.config.hidden_size, str(spec).rstrip("/").rsplit("/", 1)[-1]
    head_file = path / HEAD_FILE
    if run_folder and head_file.is_file():
        with safe_open(str(head_file), "pt") as opened:
            classes = tuple(json.loads((opened.metadata() or {}).get("classes", "[]")))
        state = load_file(head_file)
        names = classes or tuple(str(i) for i in range(state["head.weight"].shape[0]))
        head = SupervisedObjective(width, names, 0.0, pooled=classic)
        try:
            head.load_state_dict(state)
        except RuntimeError as error:
            raise TeacherError(f"{head_file} is not a head of this {width}-wide tower: {error}") from error
    elif isinstance(tower, ClassicViT) and tower.config.num_classes > 0:
        classes = ()
        names = tuple(str(i) for i in range(tower.config.num_classes))
        head = SupervisedObjective(width, names, 0.0, tower_head=True, pooled=True)
    else:
        has = "a tower without a head" if not run_folder else f"a run folder without {HEAD_FILE}"
        raise TeacherError(
            f"{spec} holds {has}: the teacher must classify (a classic ViT / DeiT with its head, or a supervised "
            f"run's --out with {HEAD_FILE})"
        )
    head.eval().requires_grad_(False)
    return TeacherClassifier(tower, head, processor, classes, name)


class DeiTObjective(Objective):
    """DeiT's hard-label distillation into a tower with a distillation token (see the module docstring)."""

    name = "deit"
    sum_names = ("correct",)
    needs_full_pixels = True  # the teacher sees every patch of each image
    pixel_scale: torch.Tensor
    pixel_shift: torch.Tensor

    def __init__(
        self,
        student: Encoder,
        student_processor: MoonViTImageProcessor,
        teacher: TeacherClassifier,
        classes: Sequence[str],
        smoothing: float = 0.1,
    ) -> None:
        super().__init__()
        sc, tc = student.config, teacher.tower.config
        if not (isinstance(student, ClassicViT) and student.config.distillation_token):
            raise TeacherError(NOT_DEIT)
        if sc.patch_size != tc.patch_size or sc.num_channels != tc.num_channels:
            raise TeacherError(
                f"the teacher's patches ({tc.patch_size} px, {tc.num_channels} channels) are not the student's "
                f"({sc.patch_size} px, {sc.num_channels} channels): the teacher runs on the student's packed patches"
            )
        if teacher.num_classes != len(classes):
            raise TeacherError(
                f"the teacher classifies into {teacher.num_classes} classes, the dataset has {len(classes)}"
            )
        if teacher.classes and tuple(teacher.classes) != tuple(classes):
            raise TeacherError(f"the teacher's classes {list(teacher.classes)} are not the dataset's {list(classes)}")
        self.classes = tuple(classes)
        self.smoothing = smoothing
        self.grid_unit = math.lcm(*tc.merge_kernel_size)  # a MoonViT teacher's grids are whole merges
        # Pixels in the student's normalisation -> the teacher's: x_t = x_s * scale + shift, per channel.
        s_mean, s_std = _channel_stats(student_processor, "student", sc.num_channels)
        t_mean, t_std = _channel_stats(teacher.processor, "teacher", sc.num_channels)
        self.register_buffer("pixel_scale", s_std / t_std, persistent=False)
        self.register_buffer("pixel_shift", (s_mean - t_mean) / t_std, persistent=False)
        self.__dict__["teacher"] = teacher  # not a submodule: see the module docstring

    @property
    def teacher(self) -> TeacherClassifier:
        return self.__dict__["teacher"]

    # ---- command line -------------------------------------------------------------------------

    @dataclass(frozen=True)
    class Options:
        teacher: str | None = None
        smoothing: float = 0.1

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        # --teacher (distill's) and --smoothing (supervised's) are shared: added here only where the others are not
        known = parser._option_string_actions
        if "--teacher" not in known:
            parser.add_argument("--teacher", type=checkpoint_source, help="the frozen teacher (distill, deit)")
        if "--smoothing" not in known:
            parser.add_argument("--smoothing", type=drop_rate, default=0.1, help="label smoothing (default: 0.1)")

    @classmethod
    def check_config(cls, config: TrainConfig, error: Callable[[str], NoReturn]) -> TrainConfig:
        if config.options.teacher is None:
            error("--objective deit needs --teacher FOLDER (the frozen classifier whose argmax the second head learns)")
        return config

    @classmethod
    def from_config(cls, encoder: Encoder, classes: Sequence[str], config: TrainConfig) -> DeiTObjective:
        """Fits the student's two heads to ``classes`` (new ones where its count differs), loads the teacher."""
        from ..build import TrainError

        o: DeiTObjective.Options = config.options
        assert o.teacher is not None  # check_config refuses a run without one
        model = config.model
        if not (isinstance(encoder, ClassicViT) and encoder.config.distillation_token):
            raise TrainError(NOT_DEIT)
        fit_heads(encoder, len(classes), distilled=True)
        freeze_unread(encoder, pooled=False, heads=True)  # the two heads read the CLS and distillation rows
        try:
            student_processor = processor_of(encoder, model.checkpoint, model.preset)
            teacher = load_teacher_classifier(o.teacher)
            return cls(encoder, student_processor, teacher, classes, o.smoothing)
        except TeacherError as failure:
            raise TrainError(f"--teacher {o.teacher}: {failure}") from failure

    # ---- the objective ------------------------------------------------------------------------

    def weight(self, items: Sequence[PlannedTrainImage]) -> int:
        return len(items)

    def metrics(self, means: dict[str, float]) -> dict[str, float]:
        return {"top1": means["correct"]}

    def teacher_labels(self, batch: Batch) -> torch.Tensor:
        """(N,) int64: the teacher's argmax on each image of the pack, every patch of it."""
        pixels = batch.full_pixels if batch.full_pixels is not None else batch.pixel_values
        if batch.full_pixels is None and batch.keep is not None:
            raise ValueError("a DeiT batch with dropped patches needs every patch (full_pixels) for the teacher")
        logits = self.teacher.logits(pixels * self.pixel_scale + self.pixel_shift, batch.grid.grid_thws)
        return logits.argmax(dim=1)

    def forward(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        out = encoder(batch.pixel_values, grid=batch.grid)
        heads = out.head_logits.float()  # (N, 2, C): the class head, the distillation head
        own = -(soft_targets(batch, len(self.classes), self.smoothing) * heads[:, 0].log_softmax(dim=1)).sum()
        taught = F.cross_entropy(heads[:, 1], self.teacher_labels(batch), reduction="sum")
        loss = (1 - DISTILL_WEIGHT) * own + DISTILL_WEIGHT * taught
        correct = (out.logits.detach().argmax(dim=1) == batch.labels).sum().float()
        return ObjectiveOutput(loss, {"correct": correct})

    @torch.no_grad()
    def evaluate(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        """The tower's inference logits (the mean of its two heads) against the labels."""
        logits = encoder(batch.pixel_values, grid=batch.grid).logits.float()
        loss = F.cross_entropy(logits, batch.labels, reduction="sum")
        correct = (logits.argmax(dim=1) == batch.labels).sum().float()
        return ObjectiveOutput(loss, {"correct": correct}, logits)

    def report(self, outputs: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]) -> dict[str, Any]:
        return {**classification_report(outputs, labels, classes), "teacher": self.teacher.name}
