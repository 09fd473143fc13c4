import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import SafeOpenSpy, random_pack, tiny_model, write_kimi_vl_folder
from safetensors.torch import load_file, save_file

import moonvit.weights.checkpoint as checkpoint
from moonvit import CheckpointError, MoonViT, MoonViTConfig

LM_TENSORS = {
    "language_model.model.embed_tokens.weight": torch.randn(1000, 64),
    "language_model.lm_head.weight": torch.randn(1000, 64),
    "multi_modal_projector.linear_1.weight": torch.randn(256, 256),
}


def assert_same_model(a: MoonViT, b: MoonViT):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_own_format_round_trips_exactly(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}
    loaded = MoonViT.from_pretrained(tmp_path)
    assert_same_model(model, loaded)
    assert loaded.config == model.config
    assert not loaded.training
    pixels, grids = random_pack([(2, 2), (4, 6)])
    assert torch.equal(loaded(pixels, grids).last_hidden_state, model(pixels, grids).last_hidden_state)


def test_own_format_uses_kimi_vl_names_without_prefix(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "patch_embed.pos_emb.weight" in names and "encoder.blocks.1.mlp.fc1.bias" in names
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "moonvit" and config["init_pos_emb_height"] == 64


def test_kimi_vl_single_file(tmp_path):
    model = tiny_model()
    write_kimi_vl_folder(tmp_path, model, other_tensors=LM_TENSORS)
    assert_same_model(model, MoonViT.from_pretrained(tmp_path))


def test_kimi_vl_sharded_reads_only_vision_tensors(tmp_path, monkeypatch):
    model = tiny_model()
    write_kimi_vl_folder(tmp_path, model, other_tensors=LM_TENSORS, sharded=True)
    spy = SafeOpenSpy(monkeypatch, checkpoint)
    loaded = MoonViT.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert spy.opened == {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"}
    assert spy.read == {f"vision_tower.{k}" for k in model.state_dict()}
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert torch.equal(loaded.patch_embed.pos_emb.weight, model.patch_embed.pos_emb.weight.bfloat16())


def test_loading_the_tower_from_a_large_checkpoint_costs_about_the_tower(tmp_path):
    """A 512 MB language model beside a 1 MB tower: peak memory grows by far less
    than the language model (measured in a fresh process, from its high-water mark)."""
    model = tiny_model()
    lm = {f"language_model.layers.{i}.weight": torch.zeros(4096, 4096) for i in range(8)}  # 8 x 64 MB
    write_kimi_vl_folder(tmp_path, model, other_tensors=lm, sharded=True)
    script = textwrap.dedent(
        f"""
        import moonvit
        def peak_mb():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM"):
                    return int(line.split()[1]) / 1024
        before = peak_mb()
        model = moonvit.MoonViT.from_pretrained({str(tmp_path)!r})
        print(peak_mb() - before)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    growth_mb = float(result.stdout.strip().splitlines()[-1])
    assert growth_mb < 100, f"peak memory grew by {growth_mb:.0f} MB"


def test_dtype_and_device(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    model = MoonViT.from_pretrained(tmp_path, dtype=torch.float64, device="cpu", attn_implementation="eager")
    assert model.dtype == torch.float64 and model.device.type == "cpu"
    assert model.config.attn_implementation == "eager"


def test_kimi_vl_config_is_read(tmp_path):
    config = {
        "vision_config": {
            "model_type": "moonvit",
            "patch_size": 14,
            "init_pos_emb_height": 64,
            "init_pos_emb_width": 64,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "merge_kernel_size": [2, 2],
            "torch_dtype": "bfloat16",
        },
        "text_config": {"hidden_size": 2048},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    parsed, layout = checkpoint.read_config(tmp_path)
    assert parsed == MoonViTConfig() and layout.prefix == "vision_tower."


def broken(tmp_path, edit):
    model = tiny_model()
    write_kimi_vl_folder(tmp_path, model)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_missing_tensor_is_named(tmp_path):
    folder = broken(tmp_path, lambda t: t.pop("vision_tower.encoder.blocks.1.wo.bias"))
    with pytest.raises(CheckpointError, match=r"missing \['vision_tower.encoder.blocks.1.wo.bias'\]"):
        MoonViT.from_pretrained(folder)


def test_unexpected_tensor_is_named(tmp_path):
    folder = broken(tmp_path, lambda t: t.update({"vision_tower.encoder.blocks.9.wo.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointError, match=r"unexpected \['vision_tower.encoder.blocks.9.wo.bias'\]"):
        MoonViT.from_pretrained(folder)


def test_wrong_shape_is_named(tmp_path):
    folder = broken(tmp_path, lambda t: t.update({"vision_tower.patch_embed.pos_emb.weight": torch.zeros(32, 32, 64)}))
    with pytest.raises(CheckpointError, match=r"patch_embed.pos_emb.weight: \(32, 32, 64\), expected \(64, 64, 64\)"):
        MoonViT.from_pretrained(folder)


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        MoonViT.from_pretrained(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="has no config.json"):
        MoonViT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        MoonViT.from_pretrained(tmp_path)
    MoonViTConfig(hidden_size=64, num_attention_heads=4).save(tmp_path)
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        MoonViT.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="names gone.safetensors"):
        MoonViT.from_pretrained(tmp_path)
