"""Feature distillation from a frozen teacher tower on packed native-resolution images.

The teacher (any tower this package loads: Kimi-VL, K2.5, K3, one trained here; another width,
depth or family than the student) encodes every patch of each image, as a user would run it. The
student encodes the same images, possibly with patches dropped (NaViT token dropping: the plan
drops them, the kept ones keep their places in the full grid), and a small adapter head maps
each kept student token to the teacher's width. The loss regresses the teacher's token at the
same patch, as AM-RADIO / RADIO do:

    loss(patch) = cosine_weight * (1 - cos(s, t)) + l1_weight * mean_c smooth_l1(s_c, t_c)

with ``t`` the teacher token standardised per channel. Why standardise, and per channel: a
tower's tokens have a few channels hundreds of times larger than the rest (the massive
activations of ViTs), and the smooth-L1 term would spend itself on those. PHI-S (Ranzinger et
al., 2024) rotates with a Hadamard matrix so every channel gets the same scale; per-channel
standardisation is the simpler choice among those it compares, it needs only the teacher's
mean and standard deviation of each channel, and for a single teacher whose channels are
roughly decorrelated after the final norm it does the same job. The statistics are measured
once, before step 0, on a calibration pass over the first ``--calibration-images`` training
images (no augmentation, every patch; the same images on every rank, so every rank computes
the same statistics without communicating), and kept with the run's state.

The loss is a sum over the student's kept patches; the engine divides by the step's kept
patches over every rank (known from the plan). The adapter is saved beside the checkpoint
(``distill_adapter.safetensors``) and is not part of the student: a user drops it.

The teacher is held outside the module tree: its weights are not trained, not in the optimiser,
not sharded or synchronised by DDP / FSDP, and not in the run's state (it is loaded again from
``--teacher`` on resume; the run's identity records it).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.nn as nn
import torch.nn.functional as F

from moonvit import CheckpointError, MoonViT, MoonViTImageProcessor, build_packed_grid
from moonvit.cli import checkpoint_source, non_negative_float, positive_int
from moonvit.files import save_safetensors_atomic

from ..batch import Batch, kept_rows
from ..classic import ClassicViT, Encoder, freeze_unread, processor_of
from ..plan import PlannedTrainImage
from .base import Objective, ObjectiveOutput

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["ADAPTER_FILE", "DistillObjective", "TeacherError"]

ADAPTER_FILE = "distill_adapter.safetensors"


class TeacherError(ValueError):
    """A ``--teacher`` that cannot be loaded or cannot see the student's patches."""


def _channel_stats(processor: MoonViTImageProcessor, whose: str, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's per-channel mean and std, each (channels, 1, 1) to broadcast over a patch
    (C, p, p); a processor normalising another channel count than the towers' is refused."""
    mean, std = torch.tensor(processor.image_mean), torch.tensor(processor.image_std)
    if mean.numel() != channels or std.numel() != channels:
        raise TeacherError(
            f"the {whose}'s processor normalises {mean.numel()} channels (image_mean) and {std.numel()} (image_std), "
            f"but the towers take {channels}"
        )
    return mean.view(channels, 1, 1), std.view(channels, 1, 1)


class Adapter(nn.Sequential):
    """The student's tokens (K, D_student) -> the teacher's width (K, D_teacher): RADIO's adaptor head,
    LayerNorm -> Linear -> GELU -> Linear, dropped after training."""

    def __init__(self, student_width: int, teacher_width: int) -> None:
        super().__init__(
            nn.LayerNorm(student_width),
            nn.Linear(student_width, teacher_width),
            nn.GELU(),
            nn.Linear(teacher_width, teacher_width),
        )


class DistillObjective(Objective):
    """Regress a frozen teacher's standardised patch tokens (see the module docstring)."""

    name = "distill"
    teacher_mean: torch.Tensor
    teacher_std: torch.Tensor
    pixel_scale: torch.Tensor
    pixel_shift: torch.Tensor
    sum_names = ("cosine",)
    needs_full_pixels = True  # the teacher sees every patch
    needs_labels = False

    def __init__(
        self,
        student: Encoder,
        student_processor: MoonViTImageProcessor,
        teacher: Encoder,
        teacher_processor: MoonViTImageProcessor,
        teacher_name: str = "teacher",
        cosine_weight: float = 0.9,
        l1_weight: float = 0.1,
        calibration_images: int = 512,
    ) -> None:
        super().__init__()
        sc, tc = student.config, teacher.config
        if sc.patch_size != tc.patch_size or sc.num_channels != tc.num_channels:
            raise TeacherError(
                f"the teacher's patches ({tc.patch_size} px, {tc.num_channels} channels) are not the student's "
                f"({sc.patch_size} px, {sc.num_channels} channels): the loss compares tokens of the same patch"
            )
        self.teacher_name = teacher_name
        self.cosine_weight, self.l1_weight = cosine_weight, l1_weight
        self.calibration_images = calibration_images
        self.grid_unit = math.lcm(*tc.merge_kernel_size)  # the teacher's grids are whole merges of its own
        self.adapter = Adapter(sc.hidden_size, tc.hidden_size)
        # The teacher's per-channel statistics (the calibration pass fills them; resumed with the state).
        self.register_buffer("teacher_mean", torch.zeros(tc.hidden_size))
        self.register_buffer("teacher_std", torch.ones(tc.hidden_size))
        # Pixels in the student's normalisation -> the teacher's: x_t = x_s * scale + shift, per channel.
        s_mean, s_std = _channel_stats(student_processor, "student", sc.num_channels)
        t_mean, t_std = _channel_stats(teacher_processor, "teacher", sc.num_channels)
        self.register_buffer("pixel_scale", s_std / t_std, persistent=False)
        self.register_buffer("pixel_shift", (s_mean - t_mean) / t_std, persistent=False)
        teacher.eval().requires_grad_(False)
        self.__dict__["teacher"] = teacher  # not a submodule: see the module docstring

    # ---- command line -------------------------------------------------------------------------

    @dataclass(frozen=True)
    class Options:
        teacher: str | None = None
        cosine_weight: float = 0.9
        l1_weight: float = 0.1
        calibration_images: int = 512

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--teacher",
            type=checkpoint_source,
            help="the frozen teacher: a checkpoint folder or hub id (distill); for deit, a classifier: a classic ViT "
            "/ DeiT folder with its head, or a supervised run's --out",
        )
        parser.add_argument(
            "--cosine-weight", type=non_negative_float, default=0.9,
            help="weight of the cosine distance to the teacher's tokens (default: 0.9, AM-RADIO's)",
        )  # fmt: skip
        parser.add_argument(
            "--l1-weight", type=non_negative_float, default=0.1,
            help="weight of the smooth-L1 distance to the standardised teacher tokens (default: 0.1)",
        )  # fmt: skip
        parser.add_argument(
            "--calibration-images", type=positive_int, default=512,
            help="training images whose teacher tokens give the per-channel standardisation (default: 512)",
        )  # fmt: skip

    @classmethod
    def check_config(cls, config: TrainConfig, error: Callable[[str], NoReturn]) -> TrainConfig:
        options: DistillObjective.Options = config.options
        if options.teacher is None:
            error("--objective distill needs --teacher DIR_OR_HUB_ID (the frozen tower to distil)")
        if options.cosine_weight == 0 and options.l1_weight == 0:
            error("--cosine-weight and --l1-weight are both 0: nothing would be learned")
        if config.augment.mixing:
            error("--objective distill regresses each image's own teacher tokens: --mixup / --cutmix do not apply")
        return config

    @classmethod
    def from_config(cls, encoder: Encoder, classes: Sequence[str], config: TrainConfig) -> DistillObjective:
        o: DistillObjective.Options = config.options
        assert o.teacher is not None  # check_config refuses a run without one
        from ..build import TrainError

        try:
            teacher = MoonViT.from_pretrained(o.teacher, dtype=torch.float32)
            teacher_processor = processor_of(teacher, o.teacher)
        except (CheckpointError, OSError, ValueError) as failure:
            raise TrainError(f"cannot load --teacher {o.teacher}: {failure}") from failure
        student_processor = processor_of(encoder, config.model.checkpoint, config.model.preset)
        if isinstance(encoder, ClassicViT):
            # The loss reads the patch rows alone: a classic tower's head(s) and MAP head stay as loaded
            freeze_unread(encoder, pooled=False, heads=False)
        name = str(o.teacher).rstrip("/").rsplit("/", 1)[-1]
        try:
            return cls(encoder, student_processor, teacher, teacher_processor, name, o.cosine_weight,
                       o.l1_weight, o.calibration_images)  # fmt: skip
        except TeacherError as failure:
            raise TrainError(f"--teacher {o.teacher}: {failure}") from failure

    @property
    def teacher(self) -> Encoder:
        return self.__dict__["teacher"]

    # ---- the teacher ----------------------------------------------------------------------------

    @torch.no_grad()
    def teacher_tokens(self, batch: Batch, standardise: bool = True) -> torch.Tensor:
        """(L_full, D_teacher) teacher tokens of every patch of the pack's images (standardised), float32
        (float64 for a float64 teacher)."""
        pixels = batch.full_pixels if batch.full_pixels is not None else batch.pixel_values
        if batch.full_pixels is None and batch.keep is not None:
            raise ValueError("a distillation batch with dropped patches needs every patch (full_pixels)")
        teacher = self.teacher
        if next(teacher.parameters()).device != pixels.device:
            teacher.to(pixels.device)
        grid = build_packed_grid(batch.grid.grid_thws, teacher.config, pixels.device)
        tokens = teacher(pixels * self.pixel_scale + self.pixel_shift, grid=grid).last_hidden_state
        tokens = tokens.to(torch.promote_types(tokens.dtype, torch.float32))
        if standardise:
            tokens = (tokens - self.teacher_mean) / self.teacher_std
        return tokens

    @torch.no_grad()
    def calibrate(self, batches: Iterable[Batch]) -> dict[str, Any]:
        """Set the teacher's per-channel mean and standard deviation from every patch of ``batches``."""
        total, sum_, sum_sq = 0, None, None
        for batch in batches:
            tokens = self.teacher_tokens(batch, standardise=False).double()
            total += tokens.shape[0]
            sum_ = tokens.sum(0) if sum_ is None else sum_ + tokens.sum(0)
            sum_sq = tokens.square().sum(0) if sum_sq is None else sum_sq + tokens.square().sum(0)
        if sum_ is None or sum_sq is None or total < 2:
            raise ValueError("the calibration pass needs at least two patches")
        mean = sum_ / total
        std = (sum_sq / total - mean.square()).clamp_min(0).sqrt().clamp_min(1e-6)
        self.teacher_mean.copy_(mean)
        self.teacher_std.copy_(std)
        return {"patches": total, "std_min": float(std.min()), "std_max": float(std.max())}

    # ---- the objective ------------------------------------------------------------------------

    def weight(self, items: Sequence[PlannedTrainImage]) -> int:
        return sum(item.kept for item in items)

    def patch_losses(self, encoder: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(K,) loss and (K,) cosine of each of the student's kept patches (float32, or float64)."""
        student = encoder(batch.pixel_values, grid=batch.grid).last_hidden_state
        prediction = self.adapter(student)
        prediction = prediction.to(torch.promote_types(prediction.dtype, torch.float32))
        target = self.teacher_tokens(batch)
        if batch.keep is not None:
            target = target.index_select(0, kept_rows(batch.grid.grid_thws, batch.keep).to(target.device))
        target = target.to(prediction.dtype)
        cosine = F.cosine_similarity(prediction, target, dim=1)
        l1 = F.smooth_l1_loss(prediction, target, reduction="none").mean(dim=1)
        return self.cosine_weight * (1 - cosine) + self.l1_weight * l1, cosine

    def forward(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        loss, cosine = self.patch_losses(encoder, batch)
        return ObjectiveOutput(loss.sum(), {"cosine": cosine.detach().sum()})

    @torch.no_grad()
    def evaluate(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        """Per image, the mean loss and cosine over its patches; the sums add those per-image means."""
        loss, cosine = self.patch_losses(encoder, batch)
        owner = batch.grid.item_index
        counts = loss.new_zeros(batch.num_images).index_add_(0, owner, torch.ones_like(loss))
        per_image = torch.stack(
            [loss.new_zeros(batch.num_images).index_add_(0, owner, values) / counts for values in (loss, cosine)], 1
        )
        return ObjectiveOutput(per_image[:, 0].sum(), {"cosine": per_image[:, 1].sum()}, per_image)

    def metrics(self, means: dict[str, float]) -> dict[str, float]:
        return {"cosine": means["cosine"]}

    def report(self, outputs: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]) -> dict[str, Any]:
        per_image = outputs.double()
        return {
            "distill_loss": float(per_image[:, 0].mean()),
            "cosine": float(per_image[:, 1].mean()),
            "teacher": self.teacher_name,
            "images": len(per_image),
        }

    def save(self, out: Path, state: dict[str, torch.Tensor]) -> list[str]:
        """``distill_adapter.safetensors``: the adapter head and the teacher's statistics (to continue)."""
        about = {"teacher": self.teacher_name, "cosine_weight": str(self.cosine_weight),
                 "l1_weight": str(self.l1_weight), "teacher_width": str(self.teacher.config.hidden_size),
                 "layers": json.dumps("LayerNorm -> Linear -> GELU -> Linear")}  # fmt: skip
        save_safetensors_atomic(state, out / ADAPTER_FILE, about)
        return [ADAPTER_FILE]
