"""Feature distillation: the packed loss against a plain per-image reference (float64, token
dropping on, a teacher of another width and depth), the teacher frozen and outside the trained
state, its calibration, pixels renormalised for a teacher's processor, the run (smoke, resume
after SIGKILL, 2-rank DDP) and its refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import randomize_, tiny_k3_model
from safetensors.torch import load_file
from test_train import free_port, kill_after_steps, run_ranks, train

from moonvit import MoonViT, MoonViTImageProcessor, build_packed_grid, patchify, preset_config
from moonvit_eval.datasets import Split
from moonvit_train.batch import Batch, ImageSource, render_pack
from moonvit_train.objectives.distill import ADAPTER_FILE, DistillObjective, TeacherError
from moonvit_train.plan import PlannedTrainImage, TokenDrop

DISTILL = ["--objective", "distill", "--preset", "tiny", "--dataset", "digits", "--threads", "1", "--no-progress"]
DISTILL += ["--resolution", "56", "--batch-patches", "512", "--randaugment", "0", "0", "--evals", "1"]
DISTILL += ["--calibration-images", "64"]


def teacher_model(seed: int = 3) -> MoonViT:
    """Another shape than the student (tiny: 2 x 64): 3 blocks x 96, 4 heads."""
    config = preset_config("tiny", hidden_size=96, num_attention_heads=4, num_hidden_layers=3, intermediate_size=192)
    return randomize_(MoonViT(config), seed).eval()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A teacher checkpoint folder whose processor normalises otherwise than the student's."""
    folder = tmp_path_factory.mktemp("teacher")
    teacher_model().save_pretrained(folder)
    MoonViTImageProcessor(image_mean=(0.4, 0.45, 0.5), image_std=(0.2, 0.25, 0.3)).save_pretrained(folder)
    return folder


def source(count: int = 12, seed: int = 0) -> ImageSource:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (count, 20, 20, 3), dtype=np.uint8)
    return ImageSource(Split(images, np.arange(count) % 3), MoonViTImageProcessor())


def planned_pack(ratio: float, grids=((4, 4), (6, 4), (4, 8))) -> list[PlannedTrainImage]:
    return [PlannedTrainImage(i, r, c, TokenDrop(ratio).kept(r * c, 0.0), 100 + i) for i, (r, c) in enumerate(grids)]


def objective_pair(
    teacher_processor: MoonViTImageProcessor | None = None, family: str = "moonvit"
) -> tuple[MoonViT, DistillObjective]:
    """A tiny student (2 x 64) and a teacher of another shape: 3 x 96, or K3's family (RMSNorm, no biases)."""
    student = randomize_(MoonViT(preset_config("tiny"))).double().eval()
    teacher = teacher_model().double() if family == "moonvit" else tiny_k3_model()
    objective = DistillObjective(
        student, MoonViTImageProcessor(), teacher, teacher_processor or MoonViTImageProcessor()
    ).double()
    width = teacher.config.hidden_size
    with torch.no_grad():  # statistics away from (0, 1), as a calibration leaves them
        objective.teacher_mean.copy_(torch.linspace(-1, 1, width, dtype=torch.float64))
        objective.teacher_std.copy_(torch.linspace(0.5, 3, width, dtype=torch.float64))
    return student, objective


def reference_loss(objective: DistillObjective, student: MoonViT, batch, index: int) -> torch.Tensor:
    """One image on its own, written out plainly: the student on its kept patches, the teacher on
    every patch, the teacher's tokens at the kept patches standardised, cosine + smooth-L1 summed."""
    start = sum(len(k) for k in batch.keep[:index])
    keep = batch.keep[index]
    r, c = batch.grid.grid_thws[index, 1:].tolist()
    full_start = int(batch.grid.grid_thws[:index].prod(dim=1).sum())
    grid = build_packed_grid([[r, c]], student.config, keep=[keep])
    tokens = student(batch.pixel_values[start : start + len(keep)], grid=grid).last_hidden_state
    prediction = objective.adapter(tokens)
    teacher = objective.teacher
    pixels = batch.full_pixels[full_start : full_start + r * c]
    with torch.no_grad():
        target = teacher(pixels, grid=build_packed_grid([[r, c]], teacher.config)).last_hidden_state[keep]
    target = (target - objective.teacher_mean) / objective.teacher_std
    cosine = (prediction * target).sum(1) / (prediction.norm(dim=1) * target.norm(dim=1))
    difference = (prediction - target).abs()
    smooth_l1 = torch.where(difference < 1, 0.5 * difference.square(), difference - 0.5).mean(1)
    return (0.9 * (1 - cosine) + 0.1 * smooth_l1).sum()


@pytest.mark.parametrize("family", ["moonvit", "k3"])
def test_the_packed_loss_is_the_sum_of_each_images_own_loss(family):
    student, objective = objective_pair(family=family)
    batch = render_pack(planned_pack(0.5), source(), student.config, None, full_pixels=True)
    batch.pixel_values, batch.full_pixels = batch.pixel_values.double(), batch.full_pixels.double()
    assert batch.keep is not None and len(batch.pixel_values) < len(batch.full_pixels)
    packed = objective(student, batch).loss_sum
    alone = sum(reference_loss(objective, student, batch, i) for i in range(3))
    torch.testing.assert_close(packed, alone, rtol=1e-9, atol=1e-9)
    assert objective.weight(planned_pack(0.5)) == 8 + 12 + 16


def test_the_teacher_is_frozen_and_outside_the_trained_state():
    student, objective = objective_pair()
    teacher = objective.teacher
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    assert not any(name.startswith("teacher") for name, _ in objective.named_parameters())
    assert set(objective.state_dict()) == {"teacher_mean", "teacher_std"} | {
        f"adapter.{k}" for k in objective.adapter.state_dict()
    }
    batch = render_pack(planned_pack(0.25), source(), student.config, None, full_pixels=True)
    batch.pixel_values, batch.full_pixels = batch.pixel_values.double(), batch.full_pixels.double()
    optimizer = torch.optim.SGD([*student.parameters(), *objective.parameters()], lr=1.0)
    objective(student, batch).loss_sum.backward()
    optimizer.step()
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert any(p.grad is not None for p in student.parameters())


def test_calibration_standardises_the_teachers_tokens():
    student, objective = objective_pair()
    batches = [render_pack(planned_pack(0.0, grids), source(), student.config, None, full_pixels=True)
               for grids in (((4, 4), (6, 4)), ((4, 8), (2, 2)))]  # fmt: skip
    for batch in batches:
        batch.pixel_values = batch.pixel_values.double()
        batch.full_pixels = batch.full_pixels.double()
    summary = objective.calibrate(batches)
    raw = torch.cat([objective.teacher_tokens(b, standardise=False) for b in batches])
    assert summary["patches"] == len(raw) == 16 + 24 + 32 + 4
    torch.testing.assert_close(objective.teacher_mean, raw.mean(0), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(objective.teacher_std, raw.std(0, unbiased=False), rtol=1e-9, atol=1e-9)
    standardised = torch.cat([objective.teacher_tokens(b) for b in batches])
    torch.testing.assert_close(standardised.mean(0), torch.zeros(96, dtype=torch.float64), atol=1e-9, rtol=0)


def test_the_teacher_sees_pixels_in_its_own_normalisation():
    teacher_processor = MoonViTImageProcessor(image_mean=(0.4, 0.45, 0.5), image_std=(0.2, 0.25, 0.3))
    student, objective = objective_pair(teacher_processor)
    batch = render_pack(planned_pack(0.0), source(), student.config, None, full_pixels=True)
    uint8 = source().processor.to_images(batch.full_pixels, batch.grid.grid_thws[:, 1:])
    converted = batch.full_pixels * objective.pixel_scale + objective.pixel_shift
    # the student's normalised pixels, converted, equal the teacher's processor applied to the same uint8 pixels
    expected = torch.cat([teacher_processor.normalize(patchify(image, 14)) for image in uint8])
    torch.testing.assert_close(converted.float(), expected, rtol=1e-5, atol=1e-5)


def test_smoke_run_writes_the_student_and_its_adapter(tmp_path, teacher_dir, capsys):
    results = train(*DISTILL, "--teacher", teacher_dir, "--smoke", "--token-drop", "0.5", "--out", tmp_path)
    assert "distill: calibrated on images 64" in capsys.readouterr().out
    assert results["objective"] == "distill" and results["test"]["teacher"] == teacher_dir.name
    assert -1 <= results["test"]["cosine"] <= 1 and -1 <= results["val"]["cosine"] <= 1
    assert MoonViT.from_pretrained(tmp_path / "checkpoint").config.hidden_size == 64
    adapter = load_file(tmp_path / ADAPTER_FILE)
    assert adapter["adapter.3.weight"].shape == (96, 96) and adapter["teacher_std"].shape == (96,)
    assert float(adapter["teacher_std"].min()) > 0 and not torch.equal(adapter["teacher_std"], torch.ones(96))


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "needs --teacher"),
        (["--teacher", "REPLACE", "--mixup", "0.2"], "do not apply"),
        (["--teacher", "REPLACE", "--cosine-weight", "0", "--l1-weight", "0"], "nothing would be learned"),
        (["--teacher", "/nonexistent/teacher"], "does not exist"),
    ],
)
def test_bad_distill_flags_are_refused(tmp_path, teacher_dir, flags, message, capsys):
    flags = [str(teacher_dir) if flag == "REPLACE" else flag for flag in flags]
    with pytest.raises(SystemExit):
        train(*DISTILL, "--steps", "1", *flags, "--out", tmp_path)
    assert message in capsys.readouterr().err


def test_a_sigkill_then_the_same_command_gives_the_uninterrupted_weights(tmp_path, teacher_dir):
    args = [*DISTILL, "--teacher", teacher_dir, "--steps", "10", "--save-every", "3", "--resolution", "28", "56"]
    args += ["--token-drop", "0.5", "--drop-path", "0.1"]
    train(*args, "--out", tmp_path / "straight")
    kill_after_steps(args, tmp_path / "killed", 4)
    train(*args, "--out", tmp_path / "killed")
    for name in ("checkpoint/model.safetensors", ADAPTER_FILE):
        straight, resumed = load_file(tmp_path / "straight" / name), load_file(tmp_path / "killed" / name)
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), name


def test_two_rank_gloo_ddp_equals_one_process(tmp_path, teacher_dir):
    args = [*DISTILL, "--teacher", str(teacher_dir), "--steps", "6", "--packs-per-step", "2", "--resolution", "28"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), "-m", "moonvit_train", *args, "--out", str(tmp_path / "ddp")]
    result = run_ranks(command)
    assert result.returncode == 0, result.stderr[-3000:]
    train(*args, "--out", tmp_path / "one")
    for name in ("checkpoint/model.safetensors", ADAPTER_FILE):
        one, two = load_file(tmp_path / "one" / name), load_file(tmp_path / "ddp" / name)
        assert max(float((one[k] - two[k]).norm() / one[k].norm()) for k in one) <= 1e-5, name


def test_two_ranks_evaluate_a_split_of_one_pack(tmp_path, teacher_dir):
    """At 2,048 patches a pack (512 images at 28 px) the validation and test splits are one pack each:
    one rank has no evaluation pack, and the ranks still meet (no hang) and agree with one process."""
    args = [*DISTILL, "--teacher", str(teacher_dir), "--steps", "2", "--packs-per-step", "2", "--resolution", "28"]
    args += ["--batch-patches", "2048"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), "-m", "moonvit_train", *args, "--out", str(tmp_path / "ddp")]
    result = run_ranks(command)  # a hang fails here, its workers killed
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "ddp" / "results.json").read_text())
    one = train(*args, "--out", tmp_path / "one")
    assert two["world_size"] == 2 and two["sizes"]["val"] <= 512 and two["sizes"]["test"] <= 512
    for split in ("val", "test"):
        assert two[split]["cosine"] == pytest.approx(one[split]["cosine"], rel=1e-4), split


def test_the_pixel_conversion_takes_the_towers_channel_count():
    """One-channel towers: the student-to-teacher pixel conversion has one channel and the teacher
    runs on the student's pixels; a processor normalising another channel count is refused."""
    student = MoonViT(preset_config("tiny", num_channels=1))
    config = preset_config("tiny", num_channels=1, hidden_size=96, num_attention_heads=4, intermediate_size=192)
    teacher = MoonViT(config)
    grey = SimpleNamespace(image_mean=(0.5,), image_std=(0.25,))
    objective = DistillObjective(student, grey, teacher, SimpleNamespace(image_mean=(0.4,), image_std=(0.2,)))
    assert objective.pixel_scale.shape == objective.pixel_shift.shape == (1, 1, 1)
    torch.testing.assert_close(objective.pixel_scale.flatten(), torch.tensor([1.25]))
    one = torch.zeros(1, dtype=torch.int64)
    grid = build_packed_grid([[4, 4]], student.config)
    batch = Batch(torch.randn(16, 1, 14, 14), grid, one, one, torch.ones(1))
    assert torch.isfinite(objective(student, batch).loss_sum)
    with pytest.raises(TeacherError, match="processor normalises 3 channels .* but the towers take 1"):
        DistillObjective(student, MoonViTImageProcessor(), teacher, grey)
