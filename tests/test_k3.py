"""Kimi K3's tower (MoonViT-V2) and its patchmergerv2 projector: parity with a plain reference written
from the description, the release folder, the eps of its RMSNorm, and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    FLEX,
    SafeOpenSpy,
    k3_release_config,
    randomize_,
    tiny_k3_model,
    tiny_k3_projector,
    tiny_model,
    write_k3_release_folder,
    write_k25_release_folder,
)
from reference_k3 import reference_k3_forward, reference_k3_projector

import moonvit.weights.storage as storage
from moonvit import (
    CheckpointError,
    MoonViT,
    MoonViTConfig,
    MoonViTImageProcessor,
    MoonViTVideoProcessor,
    preset_config,
)
from moonvit.media.video import VideoInfo
from moonvit.model.blocks import make_norm
from moonvit_projector import MoonViTProjector, ProjectorConfig, k3_media_prompts

# Clips of 1 to 4 frames with odd-aspect images, and an image of exactly the table's 64 x 64 (the
# table used as it is, without resampling).
PACK = [(1, 6, 10), (2, 2, 68), (3, 66, 4), (4, 4, 6), (1, 64, 64)]


def clip_pack(thws, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in thws)
    pixels = torch.rand(n, 3, 14, 14, generator=gen, dtype=torch.float64) * 2 - 1
    return pixels.to(dtype), torch.tensor(thws, dtype=torch.int64)


def sizes_of(model: MoonViT) -> dict:
    c = model.config
    return dict(
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        attention=c.qkv_hidden_size,
        layers=c.num_hidden_layers,
        patch=c.patch_size,
        rope_theta=c.rope_theta,
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def reference64():
    """The float64 reference on PACK (tower and projector), computed once."""
    model = tiny_k3_model(seed=3)
    projector = tiny_k3_projector(model)
    pixels, grids = clip_pack(PACK)
    with torch.no_grad():
        last, merged = reference_k3_forward(model.state_dict(), sizes_of(model), pixels, grids)
        projected = reference_k3_projector(projector.state_dict(), merged, projector.config.layer_norm_eps)
    return model, projector, pixels, grids, (last, merged, projected)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_float64_parity_with_the_reference(reference64, impl):
    model, projector, pixels, grids, (last, merged, projected) = reference64
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(pixels, grids)
        ours = projector(out.merged)
    assert out.last_hidden_state.shape == last.shape and out.merged.shape == merged.shape
    assert rel(out.last_hidden_state, last) < 1e-5
    assert rel(out.merged, merged) < 1e-5
    assert rel(ours, projected) < 1e-5
    model.set_attn_implementation("auto")


@pytest.mark.parametrize("impl", ["sdpa", FLEX])
def test_bfloat16_as_close_to_exact_as_the_reference_in_bfloat16(reference64, impl):
    """Our bf16 no further from the float64 answer than the plain reference's own bf16 (25% slack)."""
    model, projector, pixels, grids, (exact, _, exact_projected) = reference64
    low, low_projector = model.to(torch.bfloat16), projector.to(torch.bfloat16)
    low.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            out = low(pixels.bfloat16(), grids)
            projected = low_projector(out.merged)
            ref_last, ref_merged = reference_k3_forward(low.state_dict(), sizes_of(low), pixels.bfloat16(), grids)
            ref_projected = reference_k3_projector(low_projector.state_dict(), ref_merged, 1e-5)
    finally:
        model.to(torch.float64), projector.to(torch.float64)
        model.set_attn_implementation("auto")
    ours, theirs = rel(out.last_hidden_state, exact), rel(ref_last, exact)
    assert ours <= 1.25 * theirs + 1e-3, (ours, theirs)
    assert rel(projected, exact_projected) <= 1.25 * rel(ref_projected, exact_projected) + 1e-3


def test_the_table_is_used_as_it_is_on_a_grid_of_its_own_size():
    model = tiny_k3_model()
    grid = model.prepare_grid([[64, 64]])
    assert grid.pos_emb_index.shape == (4096, 4)  # bilinear: 2 x 2 taps
    table = model.patch_embed.pos_emb.weight.detach()
    with torch.no_grad():
        rows = model.patch_embed.pos_emb(grid.pos_emb_index, grid.pos_emb_weight)
    assert torch.equal(rows, table.reshape(4096, -1))  # weights 1 and 0: the rows themselves


# ---- the eps of RMSNorm ------------------------------------------------------------------------------


def test_rmsnorm_built_without_eps_takes_the_eps_of_the_dtype_it_computes_in():
    """K3 builds its RMSNorms with no eps. Pinned here (torch 2.13, CPU): float32 uses float32's
    epsilon, float64 float64's, and bf16 is computed in float32 with float32's epsilon (1.19e-7),
    not bf16's 2^-7. A tiny input makes the eps visible: mean(x^2) = 1e-6."""
    norm = make_norm(8, "rmsnorm", None)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps is None
    x = torch.full((1, 8), 1e-3, dtype=torch.float64)

    def expected(eps: float) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    f32, f64, bf16 = (torch.finfo(t).eps for t in (torch.float32, torch.float64, torch.bfloat16))
    for dtype, eps, rtol in ((torch.float32, f32, 1e-6), (torch.float64, f64, 1e-12), (torch.bfloat16, f32, 2**-8)):
        with torch.no_grad():
            out = norm.to(dtype)(x.to(dtype)).double()
        torch.testing.assert_close(out, expected(eps), rtol=rtol, atol=0)
    with torch.no_grad():
        out = norm.to(torch.bfloat16)(x.bfloat16()).double()
    assert (out - expected(bf16)).abs().min() > 0.5  # bf16's own epsilon would give 0.0113, not 0.94


# ---- the config ------------------------------------------------------------------------------------


def test_the_preset_has_k3_s_size_and_switches():
    with torch.device("meta"):
        model = MoonViT.from_preset("moonvit-v2")
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.qkv_hidden_size) == (27, 1024, 12, 1536)
    assert (c.head_dim, c.intermediate_size, c.max_frames) == (128, 4096, 4)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(401e6, rel=0.01)  # "about 401 M"
    assert not any(name.endswith(".bias") for name in model.state_dict())
    assert model.encoder.blocks[0].wqkv.weight.shape == (4608, 1024)
    assert model.encoder.blocks[0].wo.weight.shape == (1024, 1536)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("norm_type", "batchnorm", "norm_type 'batchnorm' is not supported"),
        ("pos_emb_interpolation_mode", "nearest", "pos_emb_interpolation_mode 'nearest' is not supported"),
        ("attn_bias", "no", "attn_bias must be true or false, got 'no'"),
        ("linear_bias", 0, "linear_bias must be true or false, got 0"),
        ("patch_embed_proj_bias", None, "patch_embed_proj_bias must be true or false, got None"),
        ("qkv_hidden_size", 98, "qkv_hidden_size 98 is not divisible by num_attention_heads 4"),
        ("mlp_type", "swiglu", "mlp_type 'swiglu' is not supported"),
        ("activation_func", "relu", "activation_func 'relu' is not supported"),
    ],
)
def test_unknown_switch_values_are_errors_naming_the_key(tmp_path, key, value, message):
    model = tiny_k3_model()
    folder = write_k3_release_folder(tmp_path, model, tiny_k3_projector(model))
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config\.json: .*{message}"):
        MoonViT.from_pretrained(folder)


def test_kimi_vl_and_k25_configs_keep_their_defaults():
    config = MoonViTConfig()
    assert (config.norm_type, config.layer_norm_eps, config.qkv_hidden_size) == ("layernorm", 1e-5, None)
    assert config.attn_bias and config.linear_bias and config.patch_embed_proj_bias
    assert config.pos_emb_interpolation_mode == "bicubic" and config.attention_width == config.hidden_size
    with pytest.raises(ValueError, match="layer_norm_eps None .* is for norm_type 'rmsnorm'"):
        MoonViTConfig(layer_norm_eps=None)


# ---- checkpoints ---------------------------------------------------------------------------------------


def test_the_release_folder_loads_tower_projector_and_processors_from_their_shards(tmp_path, monkeypatch):
    model = tiny_k3_model(dtype=torch.float32)
    projector = tiny_k3_projector(model)
    folder = write_k3_release_folder(tmp_path, model, projector)
    spy = SafeOpenSpy(monkeypatch, storage)
    loaded = MoonViT.from_pretrained(folder)
    assert spy.opened == {"model-00001-of-00003.safetensors"}  # the tower's shard alone
    assert loaded.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    spy.opened.clear()
    loaded_projector = MoonViTProjector.from_pretrained(folder)
    assert spy.opened == {"model-00002-of-00003.safetensors"}
    assert loaded_projector.config.projector_type == "patchmergerv2" and loaded_projector.pre_norm is None
    assert set(loaded_projector.state_dict()) == {"linear_1.weight", "linear_2.weight", "post_norm.weight"}
    merged = torch.randn(5, 4, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded_projector(merged), projector(merged), rtol=0, atol=0)
    image = MoonViTImageProcessor.from_pretrained(folder)
    assert image.in_token_limit == 65536 and image.side_limit_mode == "resize"
    video = MoonViTVideoProcessor.from_pretrained(folder)
    assert (video.sample_fps, video.frame_processor.in_token_limit, video.video_patch_limit) == (8.0, 16384, 655360)
    assert MoonViTVideoProcessor.kimi_k3().to_dict() == video.to_dict()


def test_a_long_video_gets_smaller_frames_under_k3_s_video_budget():
    video = MoonViTVideoProcessor.kimi_k3()
    short = VideoInfo("short", num_frames=60, fps=30.0, size=(1920, 1080))  # 2 s at 8 fps: 16 frames
    long = VideoInfo("long", num_frames=30 * 600, fps=30.0, size=(1920, 1080))  # 10 min: 4800 frames
    assert video.frame_limit(short) == 16384  # 655360 / 16 = 40960, capped at the frame limit
    assert video.frame_limit(long) == round(655360 / 4800) == 137
    assert video.plan_frame(long).num_patches <= 137 + 2 * 20  # padding to the 2x2 merger adds a little
    assert MoonViTVideoProcessor().frame_limit(long) == 4096  # K2.5: no video budget


def test_own_format_round_trips_exactly(tmp_path):
    model = tiny_k3_model(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["norm_type"] == "rmsnorm" and saved["layer_norm_eps"] is None and saved["attn_bias"] is False
    loaded = MoonViT.from_pretrained(tmp_path)
    assert loaded.config == model.config
    assert not any(name.endswith(".bias") for name in loaded.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_k3_weights_under_a_k25_config_and_the_reverse_are_refused_by_name(tmp_path):
    k3 = tiny_k3_model(dtype=torch.float32)
    folder = write_k3_release_folder(tmp_path / "k3", k3, tiny_k3_projector(k3))
    config = json.loads((folder / "config.json").read_text())
    for key in ("qkv_hidden_size", "norm_type", "attn_bias", "linear_bias", "patch_embed_proj_bias"):
        del config["vision_config"][key]  # what a K2.5 config says
    config["vision_config"]["pos_emb_interpolation_mode"] = "bicubic"
    config["model_type"] = "kimi_k25"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        MoonViT.from_pretrained(folder)
    assert "missing" in str(error.value) and ".bias" in str(error.value)
    assert "a Kimi K3 (MoonViT-V2) tower read with a Kimi-VL / K2.5 config" in str(error.value)

    k25 = randomize_(MoonViT(preset_config("tiny-3d")))
    k25_projector = MoonViTProjector(ProjectorConfig.for_encoder(k25.config, 48))
    folder = write_k25_release_folder(tmp_path / "k25", k25, k25_projector)
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"].update(k3_release_config(k25, 48)["vision_config"] | {"qkv_hidden_size": 64})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="a Kimi-VL / K2.5 tower read with a Kimi K3"):
        MoonViT.from_pretrained(folder)


def test_a_clip_of_five_frames_is_refused():
    model = tiny_k3_model()
    pixels, grids = clip_pack([(5, 2, 2)])
    with pytest.raises(ValueError, match=r"clip 0: grid 5x2x2 has 5 frames, over the 4 this encoder takes"):
        model(pixels, grids)


def test_kimi_vl_parity_is_unchanged_by_the_switches():
    """A Kimi-VL tower built through the same modules still matches its reference."""
    from reference import reference_forward

    model = tiny_model(seed=5, dtype=torch.float64)
    pixels = torch.rand(4 * 6 + 2 * 68, 3, 14, 14, dtype=torch.float64)
    grids = torch.tensor([[4, 6], [2, 68]])
    with torch.no_grad():
        out = model(pixels, grids)
        last, merged = reference_forward(model.state_dict(), model.config, pixels, grids)
    assert rel(out.last_hidden_state, last) < 1e-5 and rel(out.merged, merged) < 1e-5


# ---- downstream: the main job, the export, the probe --------------------------------------------------


def test_the_command_lines_take_a_k3_folder(tmp_path, capsys):
    from helpers import run_export, write_video
    from PIL import Image
    from safetensors.torch import load_file

    from moonvit.__main__ import main as moonvit_main
    from moonvit_eval.linear_probe import main as probe_main

    model = tiny_k3_model(dtype=torch.float32)
    folder = write_k3_release_folder(tmp_path / "k3", model, tiny_k3_projector(model))
    Image.new("RGB", (70, 42), (200, 40, 90)).save(tmp_path / "a.png")
    write_video(tmp_path / "clip.mkv", 10, 10.0, size=(40, 30))  # 1 s at 10 fps, sampled at K3's 8 fps: 8 frames
    out = tmp_path / "main"
    moonvit_main(["--checkpoint", str(folder), "--images", str(tmp_path / "a.png"), "--videos",
                  str(tmp_path / "clip.mkv"), "--dtype", "fp32", "--out", str(out)])  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())["images"]
    assert [(e["image"], e.get("frames", 1)) for e in summary] == [("a.png", 1), ("clip.mkv#0", 4), ("clip.mkv#1", 4)]
    assert "processor: Kimi K3's rule: images 65536 patches" in capsys.readouterr().out  # the header names it
    assert load_file(out / "merged.safetensors")["a.png"].shape[1:] == (4, 64)

    (tmp_path / "inputs").mkdir()
    Image.new("RGB", (56, 28)).save(tmp_path / "inputs" / "b.png")
    run_export("--inputs", tmp_path / "inputs", "--checkpoint", folder, "--out", tmp_path / "export", "--store", "both")
    manifest = [json.loads(line) for line in (tmp_path / "export" / "manifest.jsonl").read_text().splitlines()]
    shard = load_file(tmp_path / "export" / manifest[0]["shard"])
    assert shard["projected"].shape == (2, 48) and shard["merged"].shape == (2, 4, 64)
    assert k3_media_prompts(manifest) == ["<|media_begin|>image 56x28<|media_content|><|media_pad|><|media_end|>"]

    tree = tmp_path / "tree"
    for name in ("cat", "dog"):
        (tree / name).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (30, 20), (40 * i, 100 if name == "cat" else 0, 0)).save(tree / name / f"{i}.png")
    results = probe_main(["--checkpoint", str(folder), "--dataset", f"imagefolder:{tree}", "--out", str(tmp_path / "p"),
                          "--min-steps", "20", "--lrs", "0.1", "--weight-decays", "0", "--threads", "1",
                          "--short-side", "28", "--no-baseline"])  # fmt: skip
    assert 0.0 <= results["top1"] <= 1.0 and results["encoder"]["num_parameters"] == sum(
        p.numel() for p in model.parameters()
    )


# ---- the processors' rules -----------------------------------------------------------------------


def test_the_video_budget_sets_the_frames_scale_and_padding_may_exceed_it_as_in_the_release():
    """The release resizes each frame with the image rule at the video's per-frame limit: the limit
    sets the scale, sqrt(limit / ((W // 14) (H // 14))), and nothing counts the padded frames
    against in_patch_limit_video, so a minute of 640x480 at 8 fps ends 9.6% over it."""
    video = MoonViTVideoProcessor.kimi_k3()
    info = VideoInfo("vga", num_frames=30 * 60, fps=30.0, size=(640, 480))  # 480 frames sampled
    limit = video.frame_limit(info)
    assert limit == round(655360 / 480) == 1365
    plan = video.plan_frame(info)
    scale = (limit / ((640 // 14) * (480 // 14))) ** 0.5
    assert plan.resized_size == (int(640 * scale), int(480 * scale)) == (604, 453)
    assert plan.grid_hw == (34, 44) and plan.num_patches == 1496  # padded to 476 x 616 px
    assert 480 * plan.num_patches == 718_080 > 655_360  # what the release gives too: counted before padding


def test_a_k3_training_run_saves_k3_s_processors(tmp_path):
    from moonvit_train.loop import main as train_main

    out = tmp_path / "run"
    train_main(["--objective", "mae", "--preset", "tiny-v2", "--dataset", "digits", "--threads", "1",
                "--no-progress", "--resolution", "28", "--batch-patches", "1024", "--steps", "1", "--evals", "0",
                "--out", str(out)])  # fmt: skip
    folder = out / "checkpoint"
    assert MoonViTImageProcessor.from_pretrained(folder) == MoonViTImageProcessor.kimi_k3()
    assert MoonViTVideoProcessor.from_pretrained(folder) == MoonViTVideoProcessor.kimi_k3()
