"""Feature views, pack-wise extraction and the feature cache of the linear probe (tiny encoders)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_model

from moonvit import MoonViT, MoonViTImageProcessor
from moonvit_eval.datasets import Split
from moonvit_eval.encoder import FrozenEncoder, load_frozen_encoder, weights_hash
from moonvit_eval.features import FeatureCache, ResizePolicy, encoder_views, extract_features, split_features


def frozen(seed: int = 0, **overrides) -> FrozenEncoder:
    model = tiny_model(seed, **overrides)
    return FrozenEncoder(model, MoonViTImageProcessor(), f"tiny seed {seed}", weights_hash(model, f"tiny:{seed}"))


def images(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 28, 28), dtype=np.uint8)


def test_views_match_direct_means_of_one_image():
    model = tiny_model(0, num_hidden_layers=4)
    pixels = torch.randn(16, 3, 14, 14)
    output = model(pixels, [(4, 4)], output_hidden_states=True)
    views = encoder_views(output, torch.tensor([[4, 4]]), ["mean", "merged-mean", "last4"])
    torch.testing.assert_close(views["mean"][0], output.last_hidden_state.mean(0))
    torch.testing.assert_close(views["merged-mean"][0], output.merged.flatten(1).mean(0))
    torch.testing.assert_close(views["last4"][0], torch.cat([h.mean(0) for h in output.hidden_states[-4:]]))
    assert views["merged-mean"].shape == views["last4"].shape == (1, 4 * model.config.hidden_size)


def test_features_are_the_same_alone_and_inside_a_pack():
    model = tiny_model(0, num_hidden_layers=4)
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for size in [(28, 28), (20, 44), (60, 30)]]
    views = ["mean", "merged-mean", "last4"]
    packed = extract_features(model, MoonViTImageProcessor(), sources, views, resize=ResizePolicy(56))
    for i, source in enumerate(sources):
        alone = extract_features(model, MoonViTImageProcessor(), [source], views, resize=ResizePolicy(56))
        for view in views:
            torch.testing.assert_close(alone[view][0], packed[view][i], atol=1e-5, rtol=1e-5)


def test_small_budget_packs_give_the_same_features():
    model, sources = tiny_model(0), images(5)
    whole = extract_features(model, MoonViTImageProcessor(), sources, ["mean"], resize=ResizePolicy(112))
    split = extract_features(
        model, MoonViTImageProcessor(), sources, ["mean"], resize=ResizePolicy(112), max_patches_per_pack=128
    )  # two 8x8-patch images per pack
    torch.testing.assert_close(split["mean"], whole["mean"], atol=1e-5, rtol=1e-5)


def test_resize_policy_sets_the_short_side():
    from PIL import Image

    assert ResizePolicy(112)(Image.new("RGB", (28, 56))).size == (112, 224)
    assert ResizePolicy(0)(Image.new("RGB", (28, 56))).size == (28, 56)
    with pytest.raises(ValueError, match="short_side"):
        ResizePolicy(-1)


@pytest.fixture
def count_forwards(monkeypatch):
    calls = []
    forward = MoonViT.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(MoonViT, "forward", counted)
    return calls


def test_cache_is_hit_on_a_second_run_and_missed_on_changes(tmp_path, count_forwards):
    cache, split = FeatureCache(tmp_path), Split(images(6), np.arange(6) % 3)

    def features(encoder, view="mean", resize=ResizePolicy(56)):
        before = len(count_forwards)
        value, hit = split_features(encoder, split, view, dataset="toy", split_name="train", resize=resize, cache=cache)
        assert hit == (len(count_forwards) == before)
        return value, hit

    first, hit = features(frozen(0))
    assert not hit and count_forwards
    again, hit = features(frozen(0))
    assert hit
    torch.testing.assert_close(again, first)
    assert features(frozen(0), view="merged-mean")[1]  # extracted by the first forward
    assert not features(frozen(1))[1]  # other weights
    heads = frozen(0).model.config.num_attention_heads
    other_config = frozen(0, num_attention_heads=heads * 2)
    assert other_config.hash == frozen(0).hash  # the same tensors ...
    assert not features(other_config)[1]  # ... under another config
    eager = frozen(0)
    eager.model.set_attn_implementation("eager")
    assert not features(eager)[1]  # another attention backend
    assert not features(frozen(0), resize=ResizePolicy(84))[1]  # other preprocessing
    other_processor = FrozenEncoder(
        frozen(0).model, MoonViTImageProcessor(image_mean=(0.4, 0.4, 0.4)), "x", frozen(0).hash
    )
    assert not features(other_processor)[1]
    assert not split_features(
        frozen(0),
        Split(images(6, seed=1), split.labels),
        "mean",
        dataset="toy",
        split_name="train",
        resize=ResizePolicy(56),
        cache=cache,
    )[1]  # other images


def test_last4_needs_four_blocks(tmp_path):
    with pytest.raises(ValueError, match="last4"):
        split_features(
            frozen(0),
            Split(images(2), np.arange(2)),
            "last4",
            dataset="toy",
            split_name="train",
            resize=ResizePolicy(56),
            cache=FeatureCache(tmp_path),
        )


def test_preset_hash_depends_on_seed_and_needs_random_init():
    first, again = (
        load_frozen_encoder(preset="tiny", random_init=True, seed=0),
        load_frozen_encoder(preset="tiny", random_init=True, seed=0),
    )
    assert first.hash == again.hash
    assert load_frozen_encoder(preset="tiny", random_init=True, seed=1).hash != first.hash
    assert not first.model.training
    with pytest.raises(ValueError, match="--random-init"):
        load_frozen_encoder(preset="tiny")


def test_pixels_of_image_files_show_progress_and_are_cached(tmp_path, capsys, monkeypatch):
    from PIL import Image

    import moonvit_eval.features as features

    paths = []
    for i in range(5):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(images(1, seed=i)[0]).convert("RGB").resize((40, 30)).save(paths[-1])
    split = Split(paths, np.arange(5) % 2)
    cache = FeatureCache(tmp_path / "cache")
    settings = dict(dataset="imagefolder:x", split_name="train", resize=ResizePolicy(), cache=cache)
    first, hit = split_features(None, split, "pixels", **settings)
    assert not hit and first.shape == (5, 3 * features.PIXEL_SIDE**2)
    assert "imagefolder:x train pixels" in capsys.readouterr().err  # the loading's tqdm bar
    assert len(list((tmp_path / "cache").iterdir())) == 1

    def never(path):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(features, "load_image", never)
    again, hit = split_features(None, split, "pixels", **settings)
    assert hit and torch.equal(again, first)
    # another split (an image rewritten: other bytes, size and mtime) misses
    Image.new("RGB", (20, 20), (9, 9, 9)).save(paths[0])
    monkeypatch.undo()
    changed, hit = split_features(None, split, "pixels", **settings)
    assert not hit and not torch.equal(changed[0], first[0]) and torch.equal(changed[1:], first[1:])


def test_pixels_of_an_array_are_computed_not_cached(tmp_path):
    cache = FeatureCache(tmp_path / "cache")
    split = Split(images(4), np.arange(4) % 2)
    pixels, hit = split_features(
        None, split, "pixels", dataset="digits", split_name="train", resize=ResizePolicy(), cache=cache
    )
    assert not hit and torch.equal(pixels, torch.from_numpy(split.images.reshape(4, -1) / 255).float())
    assert not (tmp_path / "cache").exists()
