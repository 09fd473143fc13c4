"""The Kimi-K2.5 / K2.6 tower (MoonViT3d): clips, the temporal table, temporal pooling, the
three checkpoint layouts, against transformers' Kimi_K25VisionModel."""

import json

import pytest
import torch
from helpers import (
    FLEX,
    k25_full_model,
    random_pack,
    randomize_,
    write_k25_release_folder,
    write_k25_transformers_folders,
)

from moonvit import CheckpointError, MoonViT, preset_config
from moonvit.model.encoder import temporal_table
from moonvit_projector import MoonViTProjector, ProjectorConfig

pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
from moonvit.weights.transformers import to_transformers

# Clips of 1 to 4 frames and images of odd aspect ratios, in one pack.
MIXED = [(4, 4, 6), (1, 2, 2), (3, 2, 4), (2, 8, 8), (1, 66, 4), (4, 2, 2), (1, 2, 68), (2, 6, 10)]


def k25_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> MoonViT:
    return randomize_(MoonViT(preset_config("tiny", init_pos_emb_time=4)), seed).to(dtype).eval()


def clip_pack(grids, seed=0, dtype=torch.float32):
    pixels, _ = random_pack([(t * h, w) for t, h, w in grids], seed=seed, dtype=dtype)
    return pixels, torch.tensor(grids)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tiny_projector(model, seed=3):
    torch.manual_seed(seed)
    projector = MoonViTProjector(ProjectorConfig.for_encoder(model.config, 32))
    with torch.no_grad():
        for p in projector.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return projector.to(model.dtype).eval()


# ---- the model against transformers --------------------------------------------------------------


def test_float64_parity_on_clips_and_images():
    model = k25_model(seed=1, dtype=torch.float64)
    peer = to_transformers(model)
    pixels, grids = clip_pack(MIXED, dtype=torch.float64)
    with torch.no_grad():
        ours, theirs = model(pixels, grids), peer(pixels, grids)
    assert rel(ours.last_hidden_state, theirs.last_hidden_state) < 1e-5
    assert rel(ours.merged, theirs.pooler_output) < 1e-5
    assert ours.merged.shape == (sum(h * w for _, h, w in MIXED) // 4, 4, 64)


def test_bfloat16_as_close_to_exact_as_transformers():
    """bf16: the two codes round the temporal table, the pooled mean and the resampled table
    differently (about one bf16 step); the bound that matters is that ours is no further from
    the float64 answer than transformers' own bf16 output is, with 25% slack."""
    exact_model = k25_model(seed=2, dtype=torch.float64)
    pixels, grids = clip_pack(MIXED, dtype=torch.float64)
    with torch.no_grad():
        exact = exact_model(pixels, grids)
        model = k25_model(seed=2, dtype=torch.bfloat16)
        ours = model(pixels.bfloat16(), grids)
        theirs = to_transformers(model)(pixels.bfloat16(), grids)
    for name, peer_name in (("last_hidden_state", "last_hidden_state"), ("merged", "pooler_output")):
        ours_error = rel(getattr(ours, name), getattr(exact, name))
        theirs_error = rel(getattr(theirs, peer_name), getattr(exact, name))
        assert ours_error <= 1.25 * theirs_error + 1e-3, name
        assert ours_error < 0.03, name


def test_temporal_table_is_the_release_formula():
    """Row f + 1 = [sin(f w) | cos(f w)], w_i = 10000^(-i / (D / 2)); row 0 zero; as transformers computes it."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionPositionEmbeddings

    table = temporal_table(4, 64, torch.device("cpu"), torch.float64)
    assert table.shape == (5, 64)
    assert torch.equal(table[0], torch.zeros(64))
    assert torch.equal(table[1], torch.cat([torch.zeros(32), torch.ones(32)]).double())
    omega = 10000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)
    torch.testing.assert_close(table[3], torch.cat([(2 * omega).sin(), (2 * omega).cos()]))
    theirs = Kimi_K25VisionPositionEmbeddings(Kimi_K25VisionConfig(hidden_size=64, pos_emb_time=4))
    torch.testing.assert_close(table.float(), theirs.compute_pos_embed(), rtol=0, atol=2e-7)


def test_single_frame_chunks_get_no_temporal_row():
    """A 1-frame clip is an image: the same output with (1, h, w) and (h, w) rows, and the same
    as a Kimi-VL tower with the same weights (which has no temporal table)."""
    model = k25_model()
    pixels, grids = clip_pack([(1, 4, 6), (1, 2, 2)])
    image_only = MoonViT(preset_config("tiny"))
    image_only.load_state_dict(model.state_dict())
    with torch.no_grad():
        a = model(pixels, grids).last_hidden_state
        b = model(pixels, grids[:, 1:]).last_hidden_state
        c = image_only(pixels, grids[:, 1:]).last_hidden_state
    assert torch.equal(a, b) and torch.equal(a, c)


def test_frames_of_a_clip_attend_to_each_other_and_to_nothing_else():
    model = k25_model()
    pixels, grids = clip_pack([(3, 2, 4), (2, 4, 4)])
    with torch.no_grad():
        base = model(pixels, grids).last_hidden_state
        changed = pixels.clone()
        changed[0] += 1.0  # frame 0 of clip 0
        out = model(changed, grids).last_hidden_state
    assert (out[8:24] - base[8:24]).abs().max() > 1e-3  # its other frames see it
    torch.testing.assert_close(out[24:], base[24:], rtol=0, atol=0)  # the next clip does not


@pytest.mark.parametrize("impl", ["eager", "sdpa", FLEX])
def test_a_clip_alone_and_inside_a_pack_give_the_same_rows(impl):
    model = k25_model()
    model.set_attn_implementation(impl)
    pixels, grids = clip_pack(MIXED)
    with torch.no_grad():
        packed = model(pixels, grids)
        start = sum(t * h * w for t, h, w in MIXED[:3])
        t, h, w = MIXED[3]
        alone = model(pixels[start : start + t * h * w], grids[3:4])
    torch.testing.assert_close(packed.last_hidden_state[start : start + t * h * w], alone.last_hidden_state,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    slot = sum(h * w for _, h, w in MIXED[:3]) // 4
    torch.testing.assert_close(packed.merged[slot : slot + h * w // 4], alone.merged, rtol=1e-5, atol=1e-5)


def test_backends_agree_forward_and_backward_on_clips():
    model = k25_model(dtype=torch.float64)
    pixels, grids = clip_pack(MIXED[:4], dtype=torch.float64)
    results = {}
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        x = pixels.clone().requires_grad_(True)
        out = model(x, grids)
        (out.last_hidden_state.square().mean() + out.merged.sum()).backward()
        results[impl] = (out.merged.detach(), x.grad, model.encoder.blocks[0].wqkv.weight.grad.clone())
    for a, b in zip(results["eager"], results["sdpa"]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_clip_longer_than_the_table_is_refused():
    with pytest.raises(ValueError, match="5 frames, over the 4 this encoder takes"):
        k25_model()(torch.rand(20, 3, 14, 14), [[5, 2, 2]])


# ---- checkpoints --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k25_folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k25")
    model = k25_model(seed=4)
    projector = tiny_projector(model)
    folders = {"release": write_k25_release_folder(tmp / "release", model, projector)}
    folders.update(write_k25_transformers_folders(tmp, model, projector))
    return model, projector, folders


@pytest.mark.parametrize("layout", ["release", "hybrid", "native"])
def test_every_layout_gives_the_same_tower_and_projector(k25_folders, layout):
    model, projector, folders = k25_folders
    loaded = MoonViT.from_pretrained(folders[layout])
    assert loaded.config.init_pos_emb_time == 4 and loaded.config.hidden_size == 64
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    loaded_projector = MoonViTProjector.from_pretrained(folders[layout])
    for name, tensor in projector.state_dict().items():
        assert torch.equal(loaded_projector.state_dict()[name], tensor), name


def test_tower_and_projector_match_transformers_full_model(k25_folders):
    """From the release layout, encoder + projector equal transformers' get_video_features."""
    model, projector, folders = k25_folders
    encoder = MoonViT.from_pretrained(folders["release"], dtype=torch.float64)
    proj = MoonViTProjector.from_pretrained(folders["release"], dtype=torch.float64)
    full = k25_full_model(model, projector).double()
    pixels, grids = clip_pack(MIXED[:4], dtype=torch.float64)
    with torch.no_grad():
        ours = proj(encoder(pixels, grids).merged)
        theirs = torch.cat(full.model.get_video_features(pixels, grids).pooler_output)
    assert rel(ours, theirs) < 1e-5


def test_only_the_vision_tensors_are_read(tmp_path, monkeypatch):
    from helpers import SafeOpenSpy

    import moonvit.weights.storage as storage

    model = k25_model()
    folder = write_k25_release_folder(tmp_path, model, tiny_projector(model))
    spy = SafeOpenSpy(monkeypatch, storage)
    MoonViT.from_pretrained(folder)
    assert spy.opened == {"model-00001-of-00002.safetensors"}
    assert all(name.startswith("vision_tower.") for name in spy.read)


def test_vt_keys_are_read_explicitly(tmp_path):
    """transformers ignores vt_hidden_size (its defaults happen to equal the release); this reads it."""
    model = randomize_(MoonViT(preset_config("tiny", hidden_size=32, num_attention_heads=2, init_pos_emb_time=4)))
    folder = write_k25_release_folder(tmp_path, model, MoonViTProjector(ProjectorConfig.for_encoder(model.config, 16)))
    loaded = MoonViT.from_pretrained(folder)
    assert (loaded.config.hidden_size, loaded.config.num_attention_heads) == (32, 2)


@pytest.mark.parametrize(
    "key, value", [("pos_emb_type", "learned_3d"), ("merge_type", "sd2"), ("video_attn_type", "spatial")]
)
def test_unsupported_architecture_switches_are_refused(tmp_path, key, value):
    model = k25_model()
    folder = write_k25_release_folder(tmp_path, model, tiny_projector(model))
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"{key} '{value}' is not supported"):
        MoonViT.from_pretrained(folder)


def test_unknown_config_keys_are_named(tmp_path):
    model = k25_model()
    folder = write_k25_release_folder(tmp_path, model, tiny_projector(model))
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["vt_new_trick"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="does not read: vt_new_trick$"):  # the mm_* keys are the projector's
        MoonViT.from_pretrained(folder)


def test_a_k25_tower_round_trips_through_its_own_format(tmp_path):
    model = k25_model()
    model.save_pretrained(tmp_path)
    loaded = MoonViT.from_pretrained(tmp_path)
    assert loaded.config == model.config
    pixels, grids = clip_pack(MIXED[:3])
    with torch.no_grad():
        assert torch.equal(loaded(pixels, grids).merged, model(pixels, grids).merged)
