import json
import subprocess
import sys

from helpers import tiny_model
from safetensors.torch import load_file

from moonvit import MoonViTImageProcessor
from moonvit.__main__ import main


def test_main_job_on_the_built_in_images(tmp_path, capsys):
    main(["--preset", "tiny", "--dtype", "fp32", "--threads", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "5 images" in printed and "1 threads" in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    tokens = load_file(tmp_path / "merged.safetensors")
    assert {s["image"] for s in summary["images"]} == set(tokens)
    for entry in summary["images"]:
        h, w = entry["grid_hw"]
        assert tokens[entry["image"]].shape == (h * w // 4, 4, 64)
    # 1792x1024 is 128 x 73 = 9344 patches, over the 4096 budget: scaled by sqrt(4096 / 9344).
    stripes = next(s for s in summary["images"] if s["image"].startswith("stripes"))
    assert stripes["grid_hw"] == [50, 86]


def test_main_job_from_a_checkpoint_folder_and_files(tmp_path, capsys):
    model = tiny_model()
    model.save_pretrained(tmp_path / "ckpt")
    MoonViTImageProcessor(in_token_limit=64).save_pretrained(tmp_path / "ckpt")
    from PIL import Image

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
