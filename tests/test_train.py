"""`python -m moonvit_train`: the plan, packing, rendering, the optimiser's groups, the whole run, resume and
bad input."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import interruptible
from PIL import Image
from safetensors.torch import load_file

import moonvit_train.loop as train_loop
from moonvit import MoonViT, MoonViTImageProcessor, build_packed_grid, patchify, preset_config
from moonvit_eval.datasets import Split
from moonvit_train.augment import AugmentConfig, mix_images
from moonvit_train.batch import ImageSource, render_pack
from moonvit_train.loop import main
from moonvit_train.optim import OptimConfig, lr_factor, param_groups
from moonvit_train.plan import ImageStream, Packer, PlannedTrainImage, Resolution, TokenDrop, default_lookahead

REPO = Path(__file__).resolve().parents[1]
TINY = ["--objective", "supervised", "--preset", "tiny", "--dataset", "digits", "--threads", "1", "--no-progress"]
RUN = [*TINY, "--resolution", "28", "--batch-patches", "1024", "--token-drop", "0.25", "--drop-path", "0.1"]
RUN += ["--hflip", "0", "--lr", "3e-3", "--evals", "1"]
MIXED = ["--resolution", "28", "56", "--cutmix", "1.0", "--mixup", "0.2", "--hflip", "0.5"]
"""Every random part on: mixed resolutions, Mixup / CutMix, flips (besides RandAugment, token drop, drop path)."""


def train(*args: str | Path) -> dict:
    previous = torch.get_num_threads()
    try:
        return main([str(a) for a in args])
    finally:
        torch.set_num_threads(previous)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoint" / "model.safetensors")


# ---- plan and packing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, side",
    [
        (np.tile([28, 28], (5000, 1)), (56, 112)),  # Fashion-MNIST's size, NaViT range
        (np.tile([8, 8], (1500, 1)), (28, 56)),  # digits
        (np.stack([np.random.default_rng(0).integers(64, 512, 4000)] * 2, 1) * [1, 2] // [1, 3], (56, 224)),
    ],
)
def test_packs_use_at_least_98_percent_of_the_budget(sizes, side):
    resolution = Resolution(*side, max_patches=4096)
    for drop in (TokenDrop(), TokenDrop(0.5, 0.5), TokenDrop(0.6, 0.1)):
        stream = ImageStream(sizes, resolution, drop, seed=0)
        packer = Packer(stream, 4096, default_lookahead(4096, 40))
        packs = [packer.next_pack(step / 100) for step in range(100)]
        used = [sum(item.kept for item in pack) for pack in packs]
        assert max(used) <= 4096
        assert np.mean(used) / 4096 >= 0.98, (drop, np.mean(used) / 4096)


def test_every_image_comes_once_per_epoch_and_the_plan_resumes_exactly():
    sizes = np.tile([28, 28], (300, 1))
    resolution = Resolution(28, 84, max_patches=512)
    stream = ImageStream(sizes, resolution, TokenDrop(0.5, 0.0), seed=3)
    packer = Packer(stream, 512, 64)
    first = [packer.next_pack(0.1) for _ in range(5)]
    state = packer.state_dict()
    rest = [packer.next_pack(0.2) for _ in range(20)]
    seen = [item.index for pack in first + rest for item in pack]
    assert sorted(seen[:300]) != seen[:300] and len(set(seen[:280])) == 280  # shuffled, no repeats early on

    again = Packer(ImageStream(sizes, resolution, TokenDrop(0.5, 0.0), seed=3), 512, 64)
    again.load_state_dict(state)
    assert [again.next_pack(0.2) for _ in range(20)] == rest


def test_token_drop_counts_kept_patches_and_follows_its_schedule():
    drop = TokenDrop.parse("0.6:0.2")
    assert drop.rate(0) == 0.6 and drop.rate(1) == pytest.approx(0.2) and drop.rate(0.5) == pytest.approx(0.4)
    assert drop.kept(16, 0.0) == 6 and TokenDrop.parse("0.5").kept(16, 0.7) == 8
    with pytest.raises(ValueError, match="START:END"):
        TokenDrop.parse("a:b")


def test_resolution_keeps_the_aspect_ratio_on_merge_units_within_the_budget():
    resolution = Resolution(56, 112, max_patches=256)
    assert resolution.grid(28, 28, 0.0) == (4, 4) and resolution.grid(28, 28, 1.0) == (8, 8)
    rows, cols = resolution.grid(200, 100, 1.0)  # (width, height)
    assert (rows, cols) == (8, 16)
    rows, cols = Resolution(448, 448, max_patches=256).grid(300, 100, 1.0)
    assert rows * cols <= 256 and rows % 2 == 0 and cols % 2 == 0 and cols > 2 * rows


# ---- rendering --------------------------------------------------------------------------------


def test_kept_patches_are_the_full_images_patches_with_their_positions():
    images = np.random.default_rng(0).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    source = ImageSource(Split(images, np.array([0, 1, 2])), MoonViTImageProcessor())
    config = preset_config("tiny")
    items = [PlannedTrainImage(i, 4, 4, 16 if i == 1 else 7, seed=10 + i) for i in range(3)]
    batch = render_pack(items, source, config, None)
    full = render_pack([PlannedTrainImage(i, 4, 4, 16, 10 + i) for i in range(3)], source, config, None)
    full_grid = build_packed_grid([[4, 4]] * 3, config)
    rows = []
    for i, item in enumerate(items):
        keep = (
            torch.arange(16)
            if item.kept == 16
            else torch.from_numpy(np.sort(np.random.default_rng(item.seed).choice(16, 7, replace=False)))
        )
        rows.append(16 * i + keep)
    rows = torch.cat(rows)
    assert batch.grid.seqlens == (7, 16, 7)
    assert torch.equal(batch.pixel_values, full.pixel_values[rows])
    assert torch.equal(batch.grid.positions, full_grid.positions[rows])
    assert torch.equal(batch.grid.rope_rotation, full_grid.rope_rotation[rows])


def test_cutmix_labels_weigh_the_kept_patches_each_image_shows():
    rng = np.random.default_rng(0)
    images = [np.full((56, 56), 10 * (i + 1), dtype=np.uint8) for i in range(4)]
    keeps = [None, np.array([0, 1, 2, 3, 5, 15]), None, np.arange(0, 16, 2)]
    mixed = mix_images(images, [(4, 4)] * 4, keeps, 14, AugmentConfig(cutmix=1.0), rng)
    assert mixed.partner.tolist() == [1, 2, 3, 0]
    for i, image in enumerate(images):
        own = patchify(torch.from_numpy(image)[None], 14)[:, 0, 0, 0] == 10 * (i + 1)
        kept = torch.arange(16) if keeps[i] is None else torch.from_numpy(keeps[i])
        assert mixed.lam[i] == pytest.approx(own[kept].float().mean().item())


# ---- optimisation -----------------------------------------------------------------------------


def test_no_decay_on_norms_biases_and_the_position_table_and_layer_decay_by_depth():
    encoder = MoonViT(preset_config("tiny"))
    head = torch.nn.Linear(64, 3)
    groups = param_groups(encoder, head, OptimConfig(lr=1.0, head_lr=5.0, weight_decay=0.1, layer_decay=0.5))
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {id(p): n for n, p in encoder.named_parameters()}
    assert all(names[i].endswith("weight") and "norm" not in names[i] for i in decayed if i in names)
    assert id(encoder.patch_embed.pos_emb.weight) not in decayed
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert lr_of[id(encoder.patch_embed.proj.weight)] == 0.5**3  # depth 0 of 2 blocks + final norm
    assert lr_of[id(encoder.encoder.blocks[1].wqkv.weight)] == 0.5
    assert lr_of[id(encoder.encoder.final_layernorm.weight)] == 1.0
    assert lr_of[id(head.weight)] == 5.0


def test_warmup_then_cosine():
    factors = [lr_factor(s, 100, 10, 0.01) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == 1.0 and factors[-1] == pytest.approx(0.01)
    assert all(a >= b for a, b in itertools.pairwise(factors[9:]))


# ---- whole runs -------------------------------------------------------------------------------


def test_smoke_run_writes_a_loadable_encoder_a_head_results_and_curves(tmp_path):
    results = train(*RUN, "--smoke", "--out", tmp_path)
    assert results["test"]["top1"] > 0.3  # 10 classes: chance is 0.1
    assert results["utilisation"] >= 0.98
    encoder = MoonViT.from_pretrained(tmp_path / "checkpoint")
    assert encoder.config.drop_path_rate == 0.0 and encoder.config.num_hidden_layers == 2
    assert (tmp_path / "head.safetensors").is_file() and (tmp_path / "curves.png").is_file()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 31))
    assert {"loss", "lr", "images_per_s", "patches_per_s", "mfu", "utilisation"} <= records[0].keys()
    # the rerun of a finished run changes nothing
    before = (tmp_path / "results.json").read_text()
    assert train(*RUN, "--smoke", "--out", tmp_path)["test"] == results["test"]
    assert (tmp_path / "results.json").read_text() == before


@pytest.mark.parametrize(
    "metric, panels",
    [("top1", ["loss", "top-1 accuracy"]), ("cosine", ["loss", "cosine to the teacher"]), (None, ["loss"])],
)
def test_the_curves_draw_the_objectives_own_metric_or_the_loss_alone(tmp_path, metric, panels):
    """Supervised: top-1; distillation: its cosine; MAE (no metric): no empty second panel."""
    from moonvit_train.log import plot_curves

    extra = {} if metric is None else {metric: 0.5}
    records = [{"kind": "train", "step": s, "loss": 1 / s, **extra} for s in range(1, 6)]
    records.append({"kind": "val", "step": 5, "loss": 0.3, **extra})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", "a run", metric) == panels
    with Image.open(tmp_path / "curves.png") as png:
        assert png.width == 550 * len(panels)  # 5.5 inches a panel at 100 dpi


def kill_after_steps(args: list, out: Path, steps: int) -> None:
    """Start ``python -m moonvit_train ARGS --out OUT``, SIGKILL it once ``steps`` training steps are logged
    (or after 60 s, or when it ends by itself)."""
    command = [sys.executable, "-m", "moonvit_train", *map(str, args), "--out", str(out)]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        if log.is_file() and log.read_text().count('"train"') >= steps:
            break
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def test_a_sigkill_then_the_same_command_gives_the_uninterrupted_weights(tmp_path):
    args = [*RUN, *MIXED, "--steps", "12", "--save-every", "3"]
    train(*args, "--out", tmp_path / "straight")
    kill_after_steps(args, tmp_path / "killed", 5)
    assert not (tmp_path / "killed" / "results.json").exists()
    train(*args, "--out", tmp_path / "killed")
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert (tmp_path / "killed" / "metrics.jsonl").read_text().count('"train"') == 12


def test_a_k3_shaped_encoder_trains_resumes_and_loads(tmp_path):
    """MoonViT-V2's switches (RMSNorm, no biases, attention wider than the stream) through the whole
    engine: no weight decay on the RMSNorm weights, a SIGKILL resumed to the uninterrupted weights,
    a checkpoint that loads as a K3 tower; MAE's decoder takes the encoder's family."""
    args = [*RUN[:3], "tiny-v2", *RUN[4:], "--steps", "8", "--save-every", "2"]
    train(*args, "--out", tmp_path / "straight")
    kill_after_steps(args, tmp_path / "killed", 3)
    train(*args, "--out", tmp_path / "killed")
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    loaded = MoonViT.from_pretrained(tmp_path / "straight" / "checkpoint")
    assert (loaded.config.norm_type, loaded.config.qkv_hidden_size, loaded.config.attn_bias) == ("rmsnorm", 96, False)
    assert not any(name.endswith(".bias") for name in straight)
    groups = param_groups(loaded, torch.nn.Linear(64, 3), OptimConfig(1.0, 1.0, 0.1, 1.0))
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    norms = [m.weight for m in loaded.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 5 and not any(id(w) in decayed for w in norms)
    mae_args = ["--objective", "mae", "--preset", "tiny-v2", *TINY[4:], "--resolution", "28", "--batch-patches", "1024"]
    mae = train(*mae_args, "--steps", "2", "--evals", "0", "--out", tmp_path / "mae")
    assert mae["objective"] == "mae"
    decoder = load_file(tmp_path / "mae" / "mae_decoder.safetensors")
    assert not any(name.endswith(".bias") and ".blocks." in name for name in decoder)


def test_a_changed_argument_is_refused_naming_it(tmp_path):
    train(*RUN, "--steps", "2", "--out", tmp_path)
    with pytest.raises(SystemExit, match="--lr = 0.003, but this command gives 0.001"):
        train(*RUN, "--steps", "2", "--lr", "1e-3", "--out", tmp_path)


# ---- bad input --------------------------------------------------------------------------------


def image_folder(root: Path, classes: dict[str, int]) -> Path:
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", (30, 20), (i * 20, 0, 0)).save(root / name / f"{i}.png")
    return root


def test_an_empty_or_one_class_dataset_is_refused(tmp_path):
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no class subfolders with images"):
        train(*TINY, "--dataset", f"imagefolder:{tmp_path / 'empty'}", "--smoke", "--out", tmp_path / "o1")
    one = image_folder(tmp_path / "one", {"cat": 6})
    with pytest.raises(
        SystemExit, match=r"a classifier needs at least 2 classes with training images; this data has 1 \['cat'\]"
    ):
        train(*TINY, "--dataset", f"imagefolder:{one}", "--smoke", "--out", tmp_path / "o2")


def test_unreadable_images_are_one_line_or_left_out_and_recorded(tmp_path):
    root = image_folder(tmp_path / "scraped", {"cat": 6, "dog": 6, "owl": 1})
    (root / "empty").mkdir()
    (root / "cat" / "zero.png").write_bytes(b"")
    args = [*TINY[:4], "--resolution", "28", "--smoke", "--steps", "2", "--evals", "0"]
    with pytest.raises(SystemExit, match=r"train image .*zero\.png cannot be read .*--skip-bad-images") as error:
        train(*args, "--dataset", f"imagefolder:{root}", "--out", tmp_path / "o1")
    assert "\n" not in str(error.value)
    # a file whose header reads but whose pixels are cut short fails when its pack is rendered
    truncated = image_folder(tmp_path / "truncated", {"cat": 6, "dog": 6})
    whole = (truncated / "dog" / "3.png").read_bytes()
    (truncated / "dog" / "3.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SystemExit, match=r"image .*dog/3\.png cannot be decoded .*--skip-bad-images"):
        train(*args, "--dataset", f"imagefolder:{truncated}", "--out", tmp_path / "o2")
    # --skip-bad-images: both left out, named in results.json, beside the data's other warnings
    shutil.copy(truncated / "dog" / "3.png", root / "dog" / "cut.png")
    with pytest.warns(UserWarning) as caught:
        results = train(*args, "--dataset", f"imagefolder:{root}", "--skip-bad-images", "--out", tmp_path / "o3")
    skipped = {Path(entry["path"]).name: entry for entry in results["skipped_images"]}
    assert set(skipped) == {"zero.png", "cut.png"} and all(entry["reason"] for entry in skipped.values())
    assert any("empty" in w and "left out" in w for w in results["data_warnings"])
    assert any("one training image" in w and "'owl'" in w for w in results["data_warnings"])
    messages = [str(w.message) for w in caught]
    assert any("left out 2 unreadable images" in m for m in messages) and any("'owl'" in m for m in messages)


def interrupt_at_step(monkeypatch, step: int) -> None:
    """Ctrl-C (KeyboardInterrupt) in the middle of training step ``step`` of the next in-process run."""
    from moonvit_train.trainer import Trainer

    original = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if self.step + 1 == step:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def interrupted_then_resumed(monkeypatch, args: list, out: Path, step: int = 3) -> None:
    """``train(*args)`` into ``out`` stopped by Ctrl-C in step ``step``, then the same command again (which resumes)."""
    with monkeypatch.context() as patch:
        interrupt_at_step(patch, step)
        with pytest.raises(SystemExit):
            train(*args, "--out", out)
    train(*args, "--out", out)


def test_resuming_with_other_threads_warns_records_it_and_supervised_runs_draw_no_pictures(
    tmp_path, monkeypatch, capsys
):
    with monkeypatch.context() as patch:
        interrupt_at_step(patch, 4)
        with pytest.raises(SystemExit) as exit_:
            train(*RUN, "--steps", "6", "--save-every", "2", "--out", tmp_path)
    assert exit_.value.code == 130
    state = tmp_path / "state" / "last.pt"
    kept = f"interrupted at step 4 of 6: the checkpoint of step 2 is kept in {state}; the same command resumes from it"
    assert capsys.readouterr().err.strip().splitlines()[-1] == kept
    message = "resuming with 2 threads, where the run so far used 1 (to step 2)"
    with pytest.warns(UserWarning, match=re.escape(message)):
        results = train(*RUN, "--steps", "6", "--save-every", "2", "--threads", "2", "--out", tmp_path)
    assert results["steps"] == 6 and results["threads"] == 2
    assert [w for w in results["data_warnings"] if w.startswith(message)]  # recorded, as docs/training.md says
    assert not (tmp_path / "pictures").exists()


def test_ctrl_c_prints_one_line_naming_the_kept_step_and_exits_130(tmp_path):
    """SIGINT to a real ``python -m moonvit_train``: no traceback, one line saying which step's checkpoint is
    kept and that the same command resumes, exit status 130; the same command then resumes there."""
    args = [*RUN, "--steps", "400", "--save-every", "2", "--evals", "0"]
    command = [sys.executable, "-m", "moonvit_train", *map(str, args), "--out", str(tmp_path)]
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible
    )
    log, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if log.is_file() and log.read_text().count('"train"') >= 3:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("python -m moonvit_train did not stop on SIGINT")
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    saved = torch.load(tmp_path / "state" / "last.pt", weights_only=False)["step"]
    line = re.fullmatch(
        r"interrupted at step (\d+) of 400: the checkpoint of step (\d+) is kept in (.+); the same command "
        r"resumes from it",
        stderr.strip().splitlines()[-1],
    )
    assert line is not None, stderr[-3000:]
    assert int(line.group(2)) == saved and Path(line.group(3)) == tmp_path / "state" / "last.pt"
    assert saved < int(line.group(1)) <= saved + 2


def test_bf16_on_a_cpu_without_bf16_arithmetic_warns_and_fp32_does_not(tmp_path, monkeypatch):
    message = "--dtype bf16 on a CPU without bf16 arithmetic"
    for hardware, dtype, warned in ((False, "bf16", True), (False, "fp32", False), (True, "bf16", False)):
        monkeypatch.setattr(train_loop, "cpu_has_bf16_arithmetic", lambda hardware=hardware: hardware)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(*RUN, "--steps", "1", "--evals", "0", "--dtype", dtype, "--out", tmp_path / f"{hardware}-{dtype}")
        assert any(message in str(w.message) for w in caught) is warned, (hardware, dtype)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--teacher", "TMP"], "--teacher is for --objective distill, not --objective supervised, which would ignore"),
        (["--mask-ratio", "0.5"], "--mask-ratio is for --objective mae, not --objective supervised"),
        (["--resolution", "56", "28"], "--resolution takes MIN MAX, got MIN 56 above MAX 28"),
    ],
)
def test_flags_that_would_be_ignored_or_swapped_are_refused(tmp_path, flags, message, capsys):
    flags = [str(tmp_path) if flag == "TMP" else flag for flag in flags]
    with pytest.raises(SystemExit) as exit_:
        train(*TINY, "--steps", "1", *flags, "--out", tmp_path / "run")
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_budget_below_one_image_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--batch-patches 8 is below one image: a 56 px image has 4x4 = 16"):
        train(*TINY, "--smoke", "--resolution", "56", "--batch-patches", "8", "--out", tmp_path)


def test_a_checkpoint_of_another_shape_is_refused(tmp_path):
    tiny = MoonViT(preset_config("tiny"))
    tiny.save_pretrained(tmp_path / "tower")
    state = tiny.state_dict()
    state["encoder.blocks.0.wqkv.weight"] = torch.zeros(5, 64)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "tower" / "model.safetensors")
    args = [*TINY[:2], *TINY[4:], "--smoke", "--out", tmp_path / "run"]
    with pytest.raises(SystemExit, match="cannot load --checkpoint .*wqkv"):
        train(*args, "--checkpoint", tmp_path / "tower")
    # a resumed run whose --checkpoint folder now holds another shape
    MoonViT(preset_config("tiny")).save_pretrained(tmp_path / "tower")
    train(*args, "--checkpoint", tmp_path / "tower", "--steps", "2")
    MoonViT(preset_config("tiny", num_hidden_layers=3)).save_pretrained(tmp_path / "tower")
    with pytest.raises(SystemExit, match="encoder = '2 blocks x 64.*'3 blocks x 64"):
        train(*args, "--checkpoint", tmp_path / "tower", "--steps", "2")


def test_a_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    from moonvit_train.objectives.supervised import SupervisedObjective

    original = SupervisedObjective.forward
    calls = {"n": 0}

    def poisoned(self, encoder, batch):
        calls["n"] += 1
        output = original(self, encoder, batch)
        if calls["n"] > 4:
            output.loss_sum = output.loss_sum * float("nan")
        return output

    monkeypatch.setattr(SupervisedObjective, "forward", poisoned)
    with pytest.raises(SystemExit, match="the loss is nan .* at step 5.*from step 3, is kept"):
        train(*RUN, "--steps", "10", "--save-every", "3", "--out", tmp_path)
    state = torch.load(tmp_path / "state" / "last.pt", weights_only=False)
    assert state["step"] == 3 and all(torch.isfinite(v).all() for v in state["model"].values())


def test_help_documents_every_flag():
    result = subprocess.run([sys.executable, "-m", "moonvit_train", "--help"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0
    for flag in (
        "--token-drop",
        "--batch-patches",
        "--packs-per-step",
        "--minutes",
        "--fsdp",
        "--layer-decay",
        "--head-lr",
        "--mixup",
        "--cutmix",
        "--randaugment",
        "--smoke",
        "--save-every",
        "torchrun",
    ):
        assert flag in result.stdout


# ---- distributed ------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's workers run in process groups of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def run_ranks(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a torchrun ``command`` to its end; past ``timeout`` seconds (a hang) SIGKILL it and every
    worker below it (a plain timeout would leave the workers waiting in a collective) and fail."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the ranks did not finish in {timeout:g} s (a hang): {stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_two_rank_gloo_ddp_equals_one_process_with_the_same_global_packs(tmp_path):
    args = [*RUN, *MIXED, "--steps", "12", "--packs-per-step", "2"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), "-m", "moonvit_train", *args, "--out", str(tmp_path / "ddp")]
    result = run_ranks(command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]  # no torch warning printed by every rank
    train(*args, "--out", tmp_path / "one")
    one, two = weights(tmp_path / "one"), weights(tmp_path / "ddp")
    assert max(float((one[k] - two[k]).norm() / one[k].norm()) for k in one) <= 1e-5
    assert json.loads((tmp_path / "ddp" / "results.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_two_rank_fsdp2_equals_one_process_in_fp32(tmp_path):
    args = [*RUN, "--steps", "6", "--packs-per-step", "2", "--dtype", "fp32"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += [
        "--master-port",
        str(free_port()),
        "-m",
        "moonvit_train",
        *args,
        "--fsdp",
        "--out",
        str(tmp_path / "fsdp"),
    ]
    result = run_ranks(command)
    assert result.returncode == 0, result.stderr[-3000:]
    train(*args, "--out", tmp_path / "one")
    one, two = weights(tmp_path / "one"), weights(tmp_path / "fsdp")
    assert max(float((one[k] - two[k]).norm() / one[k].norm()) for k in one) <= 1e-5


# ---- fine-tuning a release's tower ------------------------------------------------------------


def release_folder(family: str, folder: Path) -> Path:
    """A test-size release folder of ``family`` (tower, projector, processor settings)."""
    from helpers import randomize_, tiny_locateanything, write_k25_release_folder, write_locateanything_folder

    from moonvit_projector import MoonViTProjector, ProjectorConfig

    if family == "locateanything":
        return write_locateanything_folder(folder, *tiny_locateanything())
    model = randomize_(MoonViT(preset_config("tiny", init_pos_emb_time=4)), seed=2).eval()
    projector = MoonViTProjector(ProjectorConfig.for_encoder(model.config, 32)).eval()
    return write_k25_release_folder(folder, model, projector, processor=MoonViTImageProcessor.kimi_k25())


def fine_tune(source: Path, out: Path, *flags: str) -> Path:
    """Two supervised steps from the tower at ``source``; the saved folder."""
    train(*TINY[:2], *TINY[4:], "--resolution", "28", "--batch-patches", "1024", "--steps", "2", "--evals", "0",
          "--checkpoint", source, "--out", out, *flags)  # fmt: skip
    return out / "checkpoint"


@pytest.mark.parametrize("family", ["locateanything", "kimi-k25"])
def test_a_fine_tuned_release_tower_keeps_its_projector_and_exports_projected_tokens(tmp_path, family):
    """The source's projector, unchanged, beside the fine-tuned tower (and a video tower's video rule):
    the default export (projected tokens) runs from the saved folder, through the original projector."""
    from helpers import run_export, write_images

    from moonvit.media.video import MoonViTVideoProcessor
    from moonvit_projector import MoonViTProjector
    from moonvit_projector.dataset import VisualTokenDataset

    source = release_folder(family, tmp_path / "release")
    saved = fine_tune(source, tmp_path / "run")
    original = MoonViTProjector.from_pretrained(source)
    kept = MoonViTProjector.from_pretrained(saved)
    assert (saved / "projector_config.json").is_file() and kept.config == original.config
    for name, tensor in original.state_dict().items():
        assert kept.state_dict()[name].dtype == tensor.dtype and torch.equal(kept.state_dict()[name], tensor)
    if family == "kimi-k25":
        assert MoonViTVideoProcessor.from_pretrained(saved) == MoonViTVideoProcessor.from_pretrained(source)
    encoder = MoonViT.from_pretrained(saved, dtype=torch.float32)
    assert not torch.equal(encoder.encoder.blocks[0].wqkv.weight, MoonViT.from_pretrained(source).encoder.blocks[0]
                           .wqkv.weight.float())  # fmt: skip

    write_images(tmp_path / "images", 3)
    run_export("--inputs", tmp_path / "images", "--checkpoint", saved, "--out", tmp_path / "tokens", "--dtype", "fp32")
    processor, projector = MoonViTImageProcessor.from_pretrained(saved), original.float()
    tokens = VisualTokenDataset(tmp_path / "tokens")
    for i in range(len(tokens)):
        item = tokens[i]
        batch = processor([tmp_path / "images" / item["id"]])
        with torch.no_grad():
            expected = projector(encoder(batch.pixel_values, batch.grid_hws).merged)
        torch.testing.assert_close(item["projected"], expected, rtol=1e-5, atol=1e-5)


def test_save_layout_release_writes_the_fine_tuned_tower_in_its_releases_layout(tmp_path):
    """``--save-layout release``: LocateAnything's config.json and tensor names, the tower the own layout
    holds (the same run) and the source's projector, both read back by the release loaders."""
    from moonvit.weights.storage import tensor_names
    from moonvit_projector import MoonViTProjector

    source = release_folder("locateanything", tmp_path / "release")
    own = fine_tune(source, tmp_path / "own")
    release = fine_tune(source, tmp_path / "release-run", "--save-layout", "release")
    config = json.loads((release / "config.json").read_text())
    assert config["model_type"] == "locateanything" and not (release / "projector_config.json").exists()
    assert {name.split(".")[0] for name in tensor_names(release)} == {"vision_model", "mlp1"}
    tower, reference = MoonViT.from_pretrained(release), MoonViT.from_pretrained(own)
    assert all(torch.equal(tower.state_dict()[k], v) for k, v in reference.state_dict().items())
    projector, original = MoonViTProjector.from_pretrained(release), MoonViTProjector.from_pretrained(source)
    assert all(torch.equal(projector.state_dict()[k], v) for k, v in original.state_dict().items())
    assert MoonViTImageProcessor.from_pretrained(release) == MoonViTImageProcessor.from_pretrained(source)


def test_a_tower_its_release_cannot_hold_is_one_line_and_saved_in_the_own_layout_after(tmp_path, capsys):
    """A setting the release's config has no key for (here rope_theta) stops the export, naming it; the
    same command with ``--save-layout own`` writes the trained tower from the saved final state."""
    tower = MoonViT(preset_config("tiny", rope_theta=5000.0))
    tower.save_pretrained(tmp_path / "tower")
    with pytest.raises(SystemExit, match=r"--save-layout release: .*rope_theta 5000.0 reads back as 10000.0"):
        fine_tune(tmp_path / "tower", tmp_path / "run", "--save-layout", "release")
    saved = fine_tune(tmp_path / "tower", tmp_path / "run", "--save-layout", "own")
    assert MoonViT.from_pretrained(saved).config.rope_theta == 5000.0
    assert "resuming" not in capsys.readouterr().out  # no step was run again
