"""benchmarks/vit_claims.py on a few hundred images and a few steps (shapes, files, determinism; not
accuracy), its locality score against a brute-force count, and the position-similarity picture of a
(G*G, D) or (G, G, D) table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

from moonvit import MoonViT
from moonvit.families.vit import ClassicViT
from moonvit.media.processor import patchify
from moonvit_eval.datasets import DEFAULT_FASHION_MNIST_DIR
from moonvit_eval.pictures import grid_table, save_table_similarity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vit_claims as vc

TINY = vc.Budget(width=32, depth=1, heads=2, mlp=64, steps=3, batch_size=16, shift=2)


def fake_pixels(count: int, seed: int) -> vc.Pixels:
    """Random 28 x 28 uint8 images with random labels, normalised as Fashion-MNIST's would be."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
    return vc.Pixels(images, rng.integers(0, 10, count), *vc.pixel_stats(images))


# ---- the data ---------------------------------------------------------------------------------


def test_patches_are_the_processors_raster_patches_image_after_image():
    images = torch.randn(3, 28, 28)
    expected = torch.cat([patchify(image[None], 4) for image in images])
    assert torch.equal(vc.to_patches(images, 4), expected)
    assert vc.to_patches(images, 4).shape == (3 * 49, 1, 4, 4)
    with pytest.raises(ValueError, match="not a multiple of the 5 px patch"):
        vc.to_patches(images, 5)


def test_shifts_are_crops_of_the_zero_padded_image_at_the_drawn_corners():
    images = torch.rand(5, 28, 28)
    assert vc.shift_images(images, 0, torch.Generator()) is images
    shifted = vc.shift_images(images, 2, torch.Generator().manual_seed(3))
    corners = torch.randint(0, 5, (5, 2), generator=torch.Generator().manual_seed(3))
    padded = F.pad(images, (2, 2, 2, 2))
    for i, (y, x) in enumerate(corners.tolist()):
        assert torch.equal(shifted[i], padded[i, y : y + 28, x : x + 28])


def test_batches_are_normalised_by_the_given_statistics():
    data = fake_pixels(10, seed=0)
    pixel_values, grid, labels = data.batch(torch.arange(4), patch=4)
    assert pixel_values.shape == (4 * 49, 1, 4, 4) and grid.tolist() == [[7, 7]] * 4
    expected = (data.images[:4].float() / 255 - data.mean) / data.std
    assert torch.allclose(pixel_values, vc.to_patches(expected, 4))
    assert torch.equal(labels, data.labels[:4])
    all_pixels = data.batch(torch.arange(10), patch=4)[0]
    assert abs(all_pixels.mean().item()) < 1e-5 and abs(all_pixels.std().item() - 1) < 1e-3


# ---- the towers -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(vc.TOWERS))
def test_each_tower_trains_scores_saves_and_loads_back(name, tmp_path):
    train, test = fake_pixels(200, seed=1), fake_pixels(60, seed=2)
    model = vc.build_tower(name, TINY)
    fit = vc.train_tower(model, train, TINY, progress=False)
    assert np.isfinite(fit["first_loss"]) and np.isfinite(fit["last_loss"]) and fit["seconds"] > 0
    top1 = vc.evaluate(model, test, TINY.patch, batch_size=25)  # batches of 25, 25 and 10
    assert 0.0 <= top1 <= 1.0 and round(top1 * 60) == pytest.approx(top1 * 60)
    assert vc.position_table(model).shape == (7, 7, 32)

    vc.save_tower(model, tmp_path / name)
    if name == "moonvit":
        loaded = MoonViT.from_pretrained(tmp_path / name).state_dict()
        saved = {f"encoder.{k}": v for k, v in loaded.items()}
        saved |= {f"head.{k}": v for k, v in load_file(tmp_path / name / "head.safetensors").items()}
    else:
        saved = ClassicViT.from_pretrained(tmp_path / name).state_dict()
    assert saved.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(saved[key], value), key


def test_the_towers_share_one_shape_and_one_seeded_run():
    """GAP differs from the CLS tower by the CLS token and its table row alone; a run is reproducible."""
    cls, gap = vc.build_tower("cls", TINY), vc.build_tower("gap", TINY)
    assert vc.tower_params(cls) - vc.tower_params(gap) == 2 * TINY.width
    assert cls.config.num_prefix_tokens == 1 and gap.config.num_prefix_tokens == 0
    data = fake_pixels(64, seed=4)
    runs = []
    for _ in range(2):
        model = vc.build_tower("moonvit", TINY)
        vc.train_tower(model, data, TINY, progress=False)
        runs.append(model.state_dict())
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def test_the_gap_tower_pools_the_mean_of_its_patch_rows():
    model = vc.build_tower("gap", TINY).eval()
    pixel_values, grid, _ = fake_pixels(3, seed=5).batch(torch.arange(3), patch=4)
    out = model(pixel_values, grid)
    assert out.prefix_tokens.shape == (3, 0, 32)
    assert torch.allclose(out.pooled, out.last_hidden_state.view(3, 49, 32).mean(dim=1), atol=1e-6)
    assert torch.allclose(out.logits, model.head(out.pooled))


# ---- locality ---------------------------------------------------------------------------------


def brute_force_locality(table: torch.Tensor, far: int) -> tuple[float, float, float]:
    """(neighbours, far, nearest-is-neighbour) by plain loops over every pair of positions."""
    h, w, _ = table.shape
    cells = [(y, x) for y in range(h) for x in range(w)]
    near, apart, hits = [], [], 0
    for a in cells:
        best, best_cell = -2.0, a
        for b in cells:
            if a == b:
                continue
            cos = F.cosine_similarity(table[a].double(), table[b].double(), dim=0).item()
            dy, dx = abs(a[0] - b[0]), abs(a[1] - b[1])
            if dy + dx == 1:
                near.append(cos)
            if max(dy, dx) >= far:
                apart.append(cos)
            if cos > best:
                best, best_cell = cos, b
        hits += abs(a[0] - best_cell[0]) + abs(a[1] - best_cell[1]) == 1
    return float(np.mean(near)), float(np.mean(apart)), hits / len(cells)


def test_locality_is_the_brute_force_count():
    table = torch.randn(3, 4, 6)
    found = vc.locality(table, far=2)
    expected = brute_force_locality(table, far=2)
    assert found["neighbours"] == pytest.approx(expected[0], abs=1e-6)
    assert found["far"] == pytest.approx(expected[1], abs=1e-6)
    assert found["nearest_is_neighbour"] == pytest.approx(expected[2])
    assert len(found["by_distance"]) == 5  # Manhattan distances 1..5 on 3 x 4
    flat = F.normalize(table.reshape(12, 6).double(), dim=1)

    def cos(a: tuple[int, int], b: tuple[int, int]) -> float:
        return float(flat[a[0] * 4 + a[1]] @ flat[b[0] * 4 + b[1]])

    directions = found["directions"]
    # 3 x 4: 8 vertical pairs, 9 horizontal, 12 diagonal (each counted both ways, the same mean)
    assert directions["above_below"] == pytest.approx(
        np.mean([cos((y, x), (y + 1, x)) for y in range(2) for x in range(4)])
    )
    assert directions["beside"] == pytest.approx(np.mean([cos((y, x), (y, x + 1)) for y in range(3) for x in range(3)]))
    diagonal = [cos((y, x), (y + 1, x + d)) for y in range(2) for x in range(4) for d in (-1, 1) if 0 <= x + d < 4]
    assert directions["diagonal"] == pytest.approx(np.mean(diagonal))
    in_line = [cos((y, x), (y, x + 2)) for y in range(3) for x in range(2)] + [cos((0, x), (2, x)) for x in range(4)]
    assert directions["in_line_2"] == pytest.approx(np.mean(in_line))


def test_locality_tells_a_smooth_table_from_a_random_one():
    ys, xs = torch.meshgrid(torch.arange(7.0), torch.arange(7.0), indexing="ij")
    centres = torch.stack([ys.flatten(), xs.flatten()], dim=1)  # (49, 2)
    # each row: Gaussian bumps around every position, so nearby rows overlap most
    smooth = torch.exp(-(torch.cdist(centres, centres) ** 2) / 4).reshape(7, 7, 49)
    score = vc.locality(smooth)
    assert score["nearest_is_neighbour"] == 1.0 and score["neighbours"] > score["far"] + 0.5
    assert score["by_distance"] == sorted(score["by_distance"], reverse=True)
    noise = vc.locality(torch.randn(7, 7, 4096))
    assert abs(noise["neighbours"]) < 0.02 and abs(noise["far"]) < 0.02


# ---- the picture ------------------------------------------------------------------------------


def test_the_picture_of_a_1d_table_is_the_picture_of_its_grid(tmp_path):
    rows = torch.randn(49, 16)
    flat = save_table_similarity(rows, tmp_path / "flat.png", "a random 1D table")
    square = save_table_similarity(rows.view(7, 7, 16).double(), tmp_path / "deep" / "grid.png", "a random 1D table")
    assert flat.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.array_equal(np.asarray(Image.open(flat)), np.asarray(Image.open(square)))
    wide = save_table_similarity(torch.randn(12, 8), tmp_path / "wide.png", "3 x 4", grid=(3, 4))
    assert Image.open(wide).width > Image.open(wide).height  # 4 maps across, 3 down
    assert torch.equal(grid_table(rows), rows.view(7, 7, 16))


def test_the_picture_names_a_table_it_cannot_lay_out(tmp_path):
    with pytest.raises(ValueError, match="50 rows is not a square grid.*prefix tokens"):
        save_table_similarity(torch.randn(50, 8), tmp_path / "x.png", "cls row left in")
    with pytest.raises(ValueError, match="12 rows does not fill a 3x5 grid"):
        grid_table(torch.randn(12, 8), (3, 5))
    with pytest.raises(ValueError, match=r"\(G\*G, D\) or \(H, W, D\), got shape \(1, 1, 49, 8\)"):
        grid_table(torch.randn(1, 1, 49, 8))
    with pytest.raises(ValueError, match="lies on a 7x7 grid, not"):
        grid_table(torch.randn(7, 7, 8), (1, 49))
    with pytest.raises(TypeError, match="floating tensor"):
        grid_table(torch.ones(49, 8, dtype=torch.int64))
    assert not (tmp_path / "x.png").exists()


# ---- the command ------------------------------------------------------------------------------


@pytest.mark.skipif(not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="Fashion-MNIST is not installed")
def test_the_command_on_a_few_hundred_images_writes_its_table_towers_and_picture(tmp_path):
    lines: list[str] = []
    argv = "--width 32 --depth 1 --heads 2 --mlp 64 --steps 2 --batch-size 32 --limit-train 256 --limit-test 100"
    results = vc.main(
        [*argv.split(), "--out", str(tmp_path / "out"), "--picture", str(tmp_path / "a.png"), "--no-progress"],
        log=lines.append,
    )
    assert [t["tower"] for t in results["towers"]] == ["cls", "gap", "moonvit"]
    assert results["train_images"] == 256 and results["test_images"] == 100 and results["host"]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["budget"]["steps"] == 2
    printed = "\n".join(lines)
    assert printed.count("| (") == 3 and f"host: {results['host']}" in printed
    for name in ("cls", "gap", "moonvit"):
        assert (tmp_path / "out" / name / "model.safetensors").is_file()
        assert (tmp_path / "out" / f"position-similarity-{name}.png").is_file()
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "out" / "position-similarity-cls.png").read_bytes()
