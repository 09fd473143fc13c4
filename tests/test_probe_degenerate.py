"""The linear probe on data it cannot or can hardly be run on: refused or warned about before any
work; and its report (the confusion PNG's title, warnings) at any class count."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from moonvit import IMAGE_EXTENSIONS
from moonvit_eval.linear_probe import main
from moonvit_eval.probe import ProbeConfig, ProbeDataWarning, check_probe_labels, run_probe
from moonvit_eval.report import save_confusion_png

FAST = ["--min-steps", "20", "--lrs", "0.1", "--weight-decays", "0", "--threads", "1", "--short-side", "28"]


def write_tree(root, counts: dict[str, int]) -> str:
    """An ImageFolder tree of small noise images: {class (or split/class): count}."""
    rng = np.random.default_rng(0)
    for name, count in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return f"imagefolder:{root}"


def refused(capsys, args) -> str:
    """Run the probe, which must refuse at once (exit 2): its last stderr line."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "counts, message",
    [
        ({"cats": 12}, r"needs at least 2 classes with training images; this data has 1 \['cats'\]"),
        (
            {"train/a": 1, "train/b": 1, "test/a": 1, "test/b": 1},
            r"selection split \(0.1 of train\) is empty",
        ),
        ({"a": 1, "b": 1, "c": 1}, "the test split has no images"),  # 1 image per class: all go to train
        ({"train/a": 5, "train/b": 4, "test/c": 2}, r"test has classes missing from"),
        ({"train/a": 5, "test/a": 2, "test/b": 1}, "has classes missing from"),
    ],
)
def test_degenerate_data_is_refused_before_any_work(tmp_path, capsys, counts, message):
    spec = write_tree(tmp_path / "data", counts)
    line = refused(
        capsys, ["--preset", "tiny", "--random-init", "--dataset", spec, "--out", str(tmp_path / "out"), *FAST]
    )
    assert line.startswith("python -m moonvit_eval.linear_probe: error: cannot probe --dataset")
    assert re.search(message, line), line
    assert not (tmp_path / "feature-cache").exists() and not (tmp_path / "out").exists()


def test_tiny_classes_are_warned_about_before_the_features_and_recorded(tmp_path, capsys):
    spec = write_tree(tmp_path / "data", {"train/a": 6, "train/b": 5, "train/c": 1, "test/a": 2, "test/b": 2})
    (tmp_path / "data" / "train" / "d").mkdir()  # a class folder with no image
    with pytest.warns(ProbeDataWarning) as caught:
        results = main(["--preset", "tiny", "--random-init", "--dataset", spec, "--out", str(tmp_path / "out"), *FAST])
    messages = [str(w.message) for w in caught]
    assert messages == [
        f"class folders of {tmp_path / 'data' / 'train'} with no image ({sorted(IMAGE_EXTENSIONS)}) are left out: 'd'",
        "classes with one training image have none in the selection split, so selection ignores them: 'c'",
        "classes with no test image have no recall and do not count in top-1: 'c'",
    ]  # once each: not again when the probe runs
    assert results["data_warnings"] == messages
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["data_warnings"] == messages and saved["per_class_recall"]["c"] is None


def test_a_view_the_depth_cannot_give_is_refused_before_the_features(tmp_path, capsys):
    line = refused(
        capsys,
        [
            "--preset",
            "tiny",
            "--random-init",
            "--dataset",
            "digits",
            "--features",
            "last4",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert line.endswith(
        "--features last4 needs an encoder of at least 4 blocks; this one has 2 (it gives mean, merged-mean)"
    )
    assert not (tmp_path / "feature-cache").exists()


def test_run_probe_refuses_what_it_cannot_select_on():
    config = ProbeConfig(learning_rates=(0.1,), weight_decays=(0.0,), min_steps=5)
    x = torch.randn(6, 3)
    with pytest.raises(ValueError, match="at least 2 classes"):
        run_probe(x, torch.zeros(6, dtype=torch.int64), x, 2, config)
    with pytest.raises(ValueError, match="selection split .* is empty"):
        run_probe(x[:2], torch.tensor([0, 1]), x, 2, config)
    with pytest.raises(ValueError, match="test split has no images"):
        run_probe(x, torch.tensor([0, 0, 0, 1, 1, 1]), x[:0], 2, config)
    with pytest.warns(ProbeDataWarning, match="one training image .* '2'"):
        run_probe(x, torch.tensor([0, 0, 1, 1, 1, 2]), x, 3, config)


def test_label_checks_name_the_classes():
    classes = ["a", "b", "c", "d"]
    train, test = np.array([0, 0, 1, 1, 2]), np.array([0, 1, 3])
    assert check_probe_labels(train, test, classes, 0.1, 0) == [
        "classes with one training image have none in the selection split, so selection ignores them: 'c'",
        "classes with test images but no training image can never be predicted: 'd'",
        "classes with no test image have no recall and do not count in top-1: 'c'",
    ]


@pytest.mark.parametrize("count", [1, 2, 3, 10, 40])
def test_the_confusion_png_shows_its_whole_title_at_any_class_count(tmp_path, count):
    title = f"imagefolder:/a/rather/long/path/to/a/dataset / merged-mean / test top-1 0.1234 ({count} classes)"
    classes = [f"class {i}" for i in range(count)]
    confusion = np.eye(count, dtype=int).tolist()
    save_confusion_png(confusion, classes, tmp_path / "c.png", title)
    image = Image.open(tmp_path / "c.png").convert("RGB")
    # The title drawn alone on an unbounded canvas, cut to the picture's width: the same pixels.
    font = ImageFont.load_default()
    alone = Image.new("RGB", (int(font.getlength(title)) + 100, 20), "white")
    ImageDraw.Draw(alone).text((8, 6), title, fill="black", font=font)
    ink = np.asarray(alone.convert("L")) < 128
    assert ink[:, image.width :].sum() == 0, "the title runs past the picture"
    width = min(image.width, alone.width)
    assert np.array_equal(np.asarray(image)[:20, :width, 0] < 128, ink[:, :width])
