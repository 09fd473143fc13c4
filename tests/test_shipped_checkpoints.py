"""The checkpoints shipped in checkpoints/: they load as documented, are within the size limit,
their cards agree with their results, and they do what their cards say on real images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from moonvit import MoonViT, MoonViTImageProcessor
from moonvit_eval.datasets import DEFAULT_FASHION_MNIST_DIR, load_dataset
from moonvit_eval.features import ResizePolicy, extract_features
from moonvit_eval.pictures import position_similarity, resampled_table

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
SHIPPED = ("fm-supervised", "fm-mae", "fm-mae-ft", "fm-distilled")
WIDTH = {"fm-distilled": 96}
needs_fashion_mnist = pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="Fashion-MNIST (Debian's dataset-fashion-mnist) not installed"
)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_checkpoint_loads_and_encodes(name):
    folder = CHECKPOINTS / name
    assert (folder / "model.safetensors").stat().st_size <= 10 * 2**20
    for file in ("config.json", "preprocessor_config.json", "README.md", "results.json"):
        assert (folder / file).is_file(), f"{name} lacks {file}"
    encoder = MoonViT.from_pretrained(folder, dtype=torch.float32)
    processor = MoonViTImageProcessor.from_pretrained(folder)
    width = WIDTH.get(name, 192)
    assert (encoder.config.num_hidden_layers, encoder.config.hidden_size) == (4, width)
    batch = processor(torch.zeros(3, 56, 84, dtype=torch.uint8))
    out = encoder(batch.pixel_values, batch.grid_hws)
    assert out.last_hidden_state.shape == (4 * 6, width) and torch.isfinite(out.last_hidden_state).all()


@pytest.mark.parametrize("name", SHIPPED)
def test_the_card_states_the_results_it_ships(name):
    folder = CHECKPOINTS / name
    card = (folder / "README.md").read_text()
    results = json.loads((folder / "results.json").read_text())
    assert results["command"] in card.replace("\\\n    ", "")
    for probe in results["probes"].values():
        assert f"{probe['top1']:.4f}" in card


def mirror_similarity(encoder: MoonViT, side: int) -> float:
    """Mean cosine similarity of positions (i, j) and (i, side - 1 - j) of the table resampled to a
    side x side grid: left-right mirror images of each other."""
    sim = position_similarity(resampled_table(encoder, side, side))
    return torch.stack([sim[i, j, i, side - 1 - j] for i in range(side) for j in range(side // 2)]).mean().item()


@pytest.mark.parametrize(("name", "side"), [("fm-supervised", 4), ("fm-mae", 6), ("fm-mae-ft", 4)])
def test_a_trained_position_table_learnt_the_flips_of_its_training(name, side):
    """All three were trained with horizontal flips at grids of side x side patches: at that grid,
    positions that flips swap came out alike (cosine about 0.3-0.4), where a random table of the
    same shape gives about 0."""
    encoder = MoonViT.from_pretrained(CHECKPOINTS / name)
    assert mirror_similarity(encoder, side) > 0.2
    torch.manual_seed(0)
    assert abs(mirror_similarity(MoonViT(encoder.config), side)) < 0.1


@needs_fashion_mnist
def test_the_supervised_checkpoint_classifies_fashion_mnist_test_images():
    """Its head (LayerNorm, Linear over each image's mean patch token) on 500 test images."""
    folder = CHECKPOINTS / "fm-supervised"
    encoder = MoonViT.from_pretrained(folder, dtype=torch.float32)
    processor = MoonViTImageProcessor.from_pretrained(folder)
    head = load_file(folder / "head.safetensors")
    test = load_dataset("fashion-mnist").test
    features = extract_features(encoder, processor, test.images[:500], ["mean"], resize=ResizePolicy(56))["mean"]
    normed = F.layer_norm(features, (192,), head["norm.weight"], head["norm.bias"], eps=1e-5)
    predicted = (normed @ head["head.weight"].T + head["head.bias"]).argmax(1)
    accuracy = (predicted.numpy() == test.labels[:500]).mean()
    assert accuracy > 0.85, accuracy
