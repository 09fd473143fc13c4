import json
import subprocess
import sys

import pytest
import torch
from helpers import tiny_model, write_video
from PIL import Image
from safetensors.torch import load_file

from moonvit import MoonViTImageProcessor
from moonvit.__main__ import main
from moonvit.model import attention


def test_main_job_on_the_built_in_images(tmp_path, capsys):
    main(["--preset", "tiny", "--dtype", "fp32", "--threads", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "5 items" in printed and "1 threads" in printed
    assert "sample-clip" not in printed  # an image-only tower gets no clip
    summary = json.loads((tmp_path / "summary.json").read_text())
    tokens = load_file(tmp_path / "merged.safetensors")
    assert {s["image"] for s in summary["images"]} == set(tokens)
    for entry in summary["images"]:
        h, w = entry["grid_hw"]
        assert tokens[entry["image"]].shape == (h * w // 4, 4, 64)
    # 1792x1024 is 128 x 73 = 9344 patches, over the 4096 budget: scaled by sqrt(4096 / 9344).
    stripes = next(s for s in summary["images"] if s["image"].startswith("stripes"))
    assert stripes["grid_hw"] == [50, 86]


def test_the_header_names_the_attention_backend_auto_took(tmp_path, capsys):
    common = ["--preset", "tiny", "--dtype", "fp32", "--threads", "1", "--images", str(tmp_path / "a.png")]
    Image.new("RGB", (56, 28), (10, 200, 30)).save(tmp_path / "a.png")
    main([*common, "--out", str(tmp_path / "auto")])
    taken = attention.resolve_attn_implementation("auto", torch.device("cpu"), torch.float32)
    assert capsys.readouterr().out.splitlines()[0].endswith(f"1 threads, attention: {taken} (auto)")
    main([*common, "--attn", "eager", "--out", str(tmp_path / "eager")])
    assert capsys.readouterr().out.splitlines()[0].endswith("1 threads, attention: eager")


def test_main_job_encodes_the_built_in_clip_with_a_temporal_tower(tmp_path, capsys):
    model = tiny_model(init_pos_emb_time=4)
    model.save_pretrained(tmp_path / "ckpt")
    MoonViTImageProcessor(in_token_limit=256).save_pretrained(tmp_path / "ckpt")
    main(["--checkpoint", str(tmp_path / "ckpt"), "--dtype", "fp32", "--threads", "1", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    tokens = load_file(tmp_path / "out" / "merged.safetensors")
    chunks = [s for s in summary["images"] if s.get("video") == "sample-clip"]
    # 3 s at 10 fps sampled at 2 fps: 6 frames spread over the clip, a 4-frame chunk from 0 s and a
    # 2-frame chunk starting at its fifth sampled frame, in the clip's last second.
    assert [(c["chunk"], c["frames"]) for c in chunks] == [(0, 4), (1, 2)]
    assert chunks[0]["timestamp"] == 0.0 and 2.0 <= chunks[1]["timestamp"] < 3.0
    assert "sample-clip#0" in printed and "7 items" in printed
    for entry in summary["images"]:
        h, w = entry["grid_hw"]
        assert tokens[entry["image"]].shape == (h * w // 4, 4, 64)


def test_main_job_from_a_checkpoint_folder_and_files(tmp_path, capsys):
    model = tiny_model()
    model.save_pretrained(tmp_path / "ckpt")
    MoonViTImageProcessor(in_token_limit=64).save_pretrained(tmp_path / "ckpt")
    Image.new("RGB", (300, 200), (10, 200, 30)).save(tmp_path / "a.png")
    main(
        [
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--images",
            str(tmp_path / "a.png"),
            "--dtype",
            "fp32",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # 21 x 14 = 294 patches > 64: scaled by sqrt(64 / 294) to 139 x 93 px, padded to 140 x 112.
    assert summary["images"][0]["grid_hw"] == [8, 10]


def test_main_job_saves_a_checkpoint_and_images_for_the_export(tmp_path, capsys):
    main(
        [
            "--preset",
            "tiny",
            "--dtype",
            "fp32",
            "--out",
            str(tmp_path / "out"),
            "--save-checkpoint",
            str(tmp_path / "ckpt"),
            "--save-images",
            str(tmp_path / "images"),
        ]
    )
    assert len(list((tmp_path / "images").glob("*.png"))) == 5
    assert MoonViTImageProcessor.from_pretrained(tmp_path / "ckpt") == MoonViTImageProcessor()
    from moonvit import MoonViT

    assert MoonViT.from_pretrained(tmp_path / "ckpt").config.hidden_size == 64


def test_help_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "moonvit", "--help"], capture_output=True, text=True, check=True)
    assert "--checkpoint" in result.stdout and "--threads" in result.stdout


def cli_error(capsys, args, status):
    """Run the main job, which must fail: its last stderr line (no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_every_input_image_comes_out_under_its_own_key(tmp_path, capsys):
    colours = {"a/x.png": (200, 0, 0), "b/x.png": (0, 200, 0), "b/x.jpg": (0, 0, 200), "b/sub/x.png": (9, 9, 9)}
    for name, colour in colours.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 30), colour).save(tmp_path / name)
    paths = [tmp_path / name for name in colours] + [tmp_path / "a/x.png"]  # the first file twice
    out = tmp_path / "out"
    main(["--preset", "tiny", "--out", str(out), "--save-images", str(out / "images"), "--images", *map(str, paths)])
    summary = json.loads((out / "summary.json").read_text())["images"]
    keys = [entry["image"] for entry in summary]
    assert keys == ["a/x.png", "b/x.png", "b/x.jpg", "b/sub/x.png", "a/x~2.png"]
    assert set(load_file(out / "merged.safetensors")) == set(keys)
    saved = [entry["saved_as"] for entry in summary]
    assert saved == ["a/x.png", "b/x.png", "b/x~2.png", "b/sub/x.png", "a/x~2.png"]
    for entry, path in zip(summary, paths):
        assert entry["path"] == str(path)
        pixel = Image.open(out / "images" / entry["saved_as"]).convert("RGB").getpixel((5, 5))
        assert pixel == Image.open(path).convert("RGB").getpixel((5, 5))  # each file saved, none overwritten
    assert len(list((out / "images").rglob("*.png"))) == 5


def test_nothing_is_written_when_an_image_fails(tmp_path, capsys):
    Image.new("RGB", (40, 30)).save(tmp_path / "good.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    out = tmp_path / "out"
    args = ["--preset", "tiny", "--out", str(out), "--save-checkpoint", str(tmp_path / "ckpt")]
    line = cli_error(capsys, [*args, "--images", str(tmp_path / "good.png"), str(tmp_path / "broken.png")], 1)
    assert line.startswith("python -m moonvit: error: input image 1:") and "broken.png" in line
    assert not out.exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--images", "{tmp}/missing.png"], "missing.png does not exist"),
        (["--images", "{tmp}/empty"], "holds no images"),
        (["--attn", "flash_attention_2"], "needs flash-attn, which is not installed"),
        (["--attn", "flash"], "unknown attention backend 'flash'"),
        (["--checkpoint", "{tmp}/file.txt"], "file.txt is a file, not a folder"),
        (["--checkpoint", "{tmp}/nowhere"], "does not exist"),
        (["--out", "{tmp}/file.txt"], "exists and is not a folder"),
        (["--save-images", "{tmp}/file.txt/images"], "is a file, not a folder"),
        (["--threads", "0"], "expected a positive integer"),
        (["--max-patches-per-pack", "2"], "patch budget of at least 4"),
        (["--seed", "-1"], "expected an integer >= 0"),
        (["--dtype", "int8"], "unknown dtype"),
    ],
)
def test_user_errors_are_one_usage_line_before_any_work(tmp_path, capsys, args, message, monkeypatch):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(attention, "_FLASH_ATTN_INSTALLED", False)  # as here, whether or not a GPU host has it
    status = 1 if "holds no images" in message else 2  # a folder's contents are read after parsing
    line = cli_error(
        capsys, ["--preset", "tiny", "--out", str(tmp_path / "o"), *[a.format(tmp=tmp_path) for a in args]], status
    )
    assert line.startswith("python -m moonvit: error:") and message in line
    assert not (tmp_path / "o").exists()


def test_flash_attention_where_it_cannot_run_is_one_line(tmp_path, capsys, monkeypatch):
    """Installed but asked for on the CPU, or in fp32: one line before any work, not a traceback."""
    monkeypatch.setattr(attention, "_FLASH_ATTN_INSTALLED", True)
    for extra, reason in (([], "flash-attn needs a CUDA device"), (["--device", "cpu"], "needs a CUDA device")):
        line = cli_error(capsys, ["--preset", "tiny", "--attn", "flash_attention_2", "--out", str(tmp_path), *extra], 1)
        assert line.startswith("python -m moonvit: error: attn_implementation='flash_attention_2' cannot run")
        assert reason in line
    assert not (tmp_path / "summary.json").exists()


def test_videos_alone_encode_no_built_in_images(tmp_path, capsys):
    write_video(tmp_path / "clip.mkv", 20, 10.0, size=(40, 30))  # 4 frames sampled at 2 fps: one chunk
    main(["--preset", "tiny-3d", "--videos", str(tmp_path / "clip.mkv"), "--out", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [entry["image"] for entry in summary["images"]] == ["clip.mkv#0"]
    assert "1 items" in capsys.readouterr().out


def test_a_video_for_an_image_only_tower_is_one_line_before_it_is_read(tmp_path, capsys):
    (tmp_path / "clip.mkv").write_text("not a video: refused before it is opened")
    line = cli_error(capsys, ["--preset", "tiny", "--videos", str(tmp_path / "clip.mkv"), "--out", str(tmp_path)], 1)
    assert "--videos clip.mkv needs a tower with a temporal table of 4 frames" in line
    assert "takes images only" in line and not (tmp_path / "summary.json").exists()


def test_a_folder_of_images_is_read_recursively(tmp_path, capsys):
    (tmp_path / "in" / "a" / "deep").mkdir(parents=True)
    Image.new("RGB", (60, 40)).save(tmp_path / "in" / "a" / "x.png")
    Image.new("RGB", (30, 90)).save(tmp_path / "in" / "a" / "deep" / "y.jpg")
    Image.new("RGB", (28, 28)).save(tmp_path / "z.png")
    (tmp_path / "in" / "notes.txt").write_text("x")
    args = ["--preset", "tiny", "--images", str(tmp_path / "in"), str(tmp_path / "z.png"), "--out", str(tmp_path / "o")]
    with pytest.warns(UserWarning, match=r"in: 1 files skipped for their extension \(\.txt 1\)"):
        main(args)
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert [entry["image"] for entry in summary["images"]] == ["in/a/deep/y.jpg", "in/a/x.png", "z.png"]


def test_a_checkpoint_that_fails_to_load_is_one_error_line(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{broken")
    line = cli_error(capsys, ["--checkpoint", str(tmp_path / "ckpt")], 1)
    assert line.startswith("python -m moonvit: error:") and "config.json is not valid JSON" in line


def test_images_scaled_to_fit_the_budget_are_flagged(tmp_path, capsys):
    Image.new("RGB", (300, 200)).save(tmp_path / "big.png")
    Image.new("RGB", (28, 28)).save(tmp_path / "small.png")
    images = [str(tmp_path / "big.png"), str(tmp_path / "small.png")]
    main(["--preset", "tiny", "--out", str(tmp_path / "out"), "--max-patches-per-pack", "64", "--images", *images])
    assert "scaled down to fit --max-patches-per-pack" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["images"]
    assert [entry["rescaled"] for entry in summary] == [True, False]
    assert summary[0]["grid_hw"][0] * summary[0]["grid_hw"][1] <= 64


def test_an_image_the_processor_cannot_fit_is_one_error_line_naming_the_flag(tmp_path, capsys):
    Image.new("RGB", (8000, 10)).save(tmp_path / "strip.png")  # 572 patches wide, never budget-scaled
    args = ["--preset", "tiny", "--out", str(tmp_path / "out"), "--images", str(tmp_path / "strip.png")]
    line = cli_error(capsys, args, 1)
    assert line.startswith("python -m moonvit: error: input image 0: a 8000x10 image gives a 2x572 patch grid")
    assert "--side-limit-mode resize" in line
    main([*args, "--side-limit-mode", "resize"])
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["images"][0]["grid_hw"] == [2, 512]
