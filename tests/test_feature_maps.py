"""The PCA feature-map picture: components against NumPy's PCA, signs aligned across encoders, the command."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import randomize_
from PIL import Image

from moonvit import MoonViT, MoonViTImageProcessor, preset_config
from moonvit_eval.feature_maps import align_signs, main, pca_rgb


def test_the_scores_are_numpys_first_three_principal_components_up_to_sign():
    rng = np.random.default_rng(0)
    tokens = [torch.from_numpy(rng.normal(size=(r, c, 16)) * np.linspace(3, 0.1, 16)) for r, c in ((3, 4), (5, 2))]
    x = np.concatenate([t.reshape(-1, 16).numpy() for t in tokens])
    x = x - x.mean(0)
    _, vectors = np.linalg.eigh(x.T @ x)  # ascending
    expected = x @ vectors[:, ::-1][:, :3]
    scores = pca_rgb(tokens).numpy()
    assert scores.shape == (22, 3)
    np.testing.assert_allclose(np.abs(scores), np.abs(expected), rtol=1e-8, atol=1e-8)


def test_signs_follow_the_reference_and_shapes_must_match():
    reference = torch.randn(30, 3, dtype=torch.float64)
    flipped = reference * torch.tensor([-1.0, 1.0, -2.0], dtype=torch.float64)
    aligned = align_signs(reference, flipped)
    assert torch.equal(aligned, reference * torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="different patches"):
        align_signs(reference, torch.randn(29, 3, dtype=torch.float64))


def test_the_command_draws_encoders_side_by_side(tmp_path, capsys):
    for seed, name in enumerate(("a", "b")):
        randomize_(MoonViT(preset_config("tiny")), seed).save_pretrained(tmp_path / name)
        MoonViTImageProcessor().save_pretrained(tmp_path / name)
    out = tmp_path / "maps.png"
    result = main(["--checkpoint", str(tmp_path / "a"), "--checkpoint", str(tmp_path / "b"),
                   "--dataset", "digits", "--count", "2", "--short-side", "56", "--out", str(out)])  # fmt: skip
    assert result["encoders"] == ["a", "b"] and f"wrote {out}" in capsys.readouterr().out
    assert Image.open(out).size[0] > Image.open(out).size[1] > 200


def test_the_command_takes_a_folder_of_unlabelled_images(tmp_path, capsys):
    randomize_(MoonViT(preset_config("tiny")), 0).save_pretrained(tmp_path / "a")
    MoonViTImageProcessor().save_pretrained(tmp_path / "a")
    photos = tmp_path / "photos"
    (photos / "nested").mkdir(parents=True)
    for i, colour in enumerate(((200, 30, 30), (30, 200, 30), (30, 30, 200))):
        Image.new("RGB", (70, 50), colour).save(photos / ("nested" if i else ".") / f"{i}.png")
    (photos / "notes.txt").write_text("not an image")
    out = tmp_path / "maps.png"
    result = main(["--checkpoint", str(tmp_path / "a"), "--dataset", f"images:{photos}", "--count", "2",
                   "--short-side", "56", "--out", str(out)])  # fmt: skip
    assert result["encoders"] == ["a"] and len(result["images"]) == 2
    assert set(result["images"]) < {"0.png", "nested/1.png", "nested/2.png"}
    assert f"wrote {out}" in capsys.readouterr().out and out.is_file()
    # more than the folder holds: every image once; a folder with no image is refused in one line
    every = main(["--checkpoint", str(tmp_path / "a"), "--dataset", f"images:{photos}", "--count", "9",
                  "--short-side", "56", "--out", str(out)])  # fmt: skip
    assert every["images"] == ["0.png", "nested/1.png", "nested/2.png"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path / "a"), "--dataset", f"images:{tmp_path / 'empty'}", "--out", str(out)])
    assert "holds no images" in capsys.readouterr().err
