"""MAE: masks, the encoder on visible patches only, the loss against a plain per-image reference,
pack invariance, the run (smoke, resume after SIGKILL, 2-rank DDP) and its picture."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import randomize_
from safetensors.torch import load_file
from test_train import REPO, free_port, kill_after_steps, train

from moonvit import MoonViT, MoonViTImageProcessor, build_packed_grid, preset_config
from moonvit.model.attention import bind_attention
from moonvit_eval.datasets import Split
from moonvit_train.batch import ImageSource, render_pack
from moonvit_train.objectives.mae import MAEObjective, patch_targets, sincos_2d
from moonvit_train.plan import PlannedTrainImage, TokenDrop

MAE = ["--objective", "mae", "--preset", "tiny", "--dataset", "digits", "--threads", "1", "--no-progress"]
MAE += ["--resolution", "56", "--batch-patches", "512", "--randaugment", "0", "0", "--evals", "1"]
MAE += ["--decoder-width", "32", "--decoder-heads", "2", "--decoder-depth", "1"]


def source(count: int = 12, seed: int = 0) -> ImageSource:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (count, 20, 20), dtype=np.uint8)
    return ImageSource(Split(images, np.arange(count) % 3), MoonViTImageProcessor())


def planned_pack(ratio: float, grids=((4, 4), (6, 4), (4, 8))) -> list[PlannedTrainImage]:
    return [PlannedTrainImage(i, r, c, TokenDrop(ratio).kept(r * c, 0.0), 100 + i) for i, (r, c) in enumerate(grids)]


def test_each_image_keeps_its_share_and_the_positions_of_its_place():
    """round(ratio * patches) masked per image; the visible rows are that image's patches at
    their own (row, col), as the full grid has them."""
    config = preset_config("tiny")
    items = planned_pack(0.75)
    batch = render_pack(items, source(), config, None, full_pixels=True)
    assert [len(k) for k in batch.keep] == [16 - 12, 24 - 18, 32 - 24]
    full = build_packed_grid(batch.grid.grid_thws, config)
    starts = full.cu_seqlens[:-1].long()
    rows = torch.cat([start + k for start, k in zip(starts, batch.keep)])
    assert torch.equal(batch.pixel_values, batch.full_pixels[rows])
    assert torch.equal(batch.grid.positions, full.positions[rows])
    assert torch.equal(batch.grid.rope_rotation, full.rope_rotation[rows])


def reference_loss(objective, encoder, batch, index):
    """One image, on its own, written out plainly: encoder on its visible patches, decoder on all."""
    start = sum(len(k) for k in batch.keep[:index])
    keep = batch.keep[index]
    r, c = batch.grid.grid_thws[index, 1:].tolist()
    full_start = int(batch.grid.grid_thws[:index].prod(dim=1).sum())
    pixels = batch.full_pixels[full_start : full_start + r * c]
    grid = build_packed_grid([[r, c]], encoder.config, keep=[keep])
    encoded = encoder(batch.pixel_values[start : start + len(keep)], grid=grid).last_hidden_state
    x = objective.mask_token.expand(r * c, -1).clone()
    x[keep] = objective.embed(encoded)
    positions = torch.stack(torch.meshgrid(torch.arange(r), torch.arange(c), indexing="ij"), -1).reshape(-1, 2)
    x = x + sincos_2d(positions, x.shape[1])
    decoder_grid = build_packed_grid([[r, c]], objective.decoder_config)
    for block in objective.blocks:
        x = block(x, decoder_grid.rope_rotation, bind_attention("eager", decoder_grid), decoder_grid)
    prediction = objective.predict(objective.norm(x))
    masked = torch.ones(r * c, dtype=torch.bool)
    masked[keep] = False
    flat = pixels.flatten(1)
    target = (flat - flat.mean(1, keepdim=True)) / (flat.var(1, keepdim=True) + 1e-6).sqrt()
    return (prediction - target).square().mean(1)[masked].sum()


def test_the_packed_loss_is_the_sum_of_each_images_own_loss():
    torch.manual_seed(0)
    encoder = randomize_(MoonViT(preset_config("tiny"))).double().eval()
    objective = MAEObjective(encoder.config, 0.75, width=32, depth=1, heads=2).double()
    batch = render_pack(planned_pack(0.75), source(), encoder.config, None, full_pixels=True)
    batch.pixel_values, batch.full_pixels = batch.pixel_values.double(), batch.full_pixels.double()
    packed = objective(encoder, batch).loss_sum
    alone = sum(reference_loss(objective, encoder, batch, i) for i in range(3))
    torch.testing.assert_close(packed, alone, rtol=1e-9, atol=1e-9)
    assert objective.weight(planned_pack(0.75)) == 12 + 18 + 24


def test_norm_pix_targets_are_per_patch_standardised():
    pixels = torch.randn(5, 3, 14, 14) * 3 + 1
    targets = patch_targets(pixels, True)
    torch.testing.assert_close(targets.mean(1), torch.zeros(5), atol=1e-5, rtol=0)
    torch.testing.assert_close(targets.std(1), torch.ones(5), atol=1e-3, rtol=0)
    assert torch.equal(patch_targets(pixels, False), pixels.flatten(1))


def test_smoke_run_writes_a_probeable_encoder_a_decoder_and_the_picture(tmp_path):
    results = train(*MAE, "--smoke", "--out", tmp_path)
    assert results["objective"] == "mae" and results["test"]["reconstruction_mse"] < 1.5
    assert MoonViT.from_pretrained(tmp_path / "checkpoint").config.hidden_size == 64
    assert (tmp_path / "mae_decoder.safetensors").is_file()
    assert (tmp_path / "pictures.png").stat().st_size > 1000
    assert list((tmp_path / "pictures").glob("step-*.png"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--token-drop", "0.5"], "masks with --mask-ratio"),
        (["--mixup", "0.2"], "do not apply"),
        (["--mask-ratio", "1"], "expected a fraction in (0, 1), got 1"),
    ],
)
def test_bad_mae_flags_are_refused(tmp_path, flags, message, capsys):
    with pytest.raises(SystemExit):
        train(*MAE, "--steps", "1", *flags, "--out", tmp_path)
    assert message in capsys.readouterr().err


def test_a_sigkill_then_the_same_command_gives_the_uninterrupted_weights(tmp_path):
    args = [*MAE, "--steps", "10", "--save-every", "3", "--resolution", "28", "56", "--drop-path", "0.1"]
    train(*args, "--out", tmp_path / "straight")
    kill_after_steps(args, tmp_path / "killed", 4)
    train(*args, "--out", tmp_path / "killed")
    for name in ("checkpoint/model.safetensors", "mae_decoder.safetensors"):
        straight, resumed = load_file(tmp_path / "straight" / name), load_file(tmp_path / "killed" / name)
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), name


def test_two_rank_gloo_ddp_equals_one_process(tmp_path):
    args = [*MAE, "--steps", "8", "--packs-per-step", "2", "--resolution", "28", "56"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), "-m", "moonvit_train", *args, "--out", str(tmp_path / "ddp")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    train(*args, "--out", tmp_path / "one")
    one = load_file(tmp_path / "one" / "checkpoint" / "model.safetensors")
    two = load_file(tmp_path / "ddp" / "checkpoint" / "model.safetensors")
    assert max(float((one[k] - two[k]).norm() / one[k].norm()) for k in one) <= 1e-5
