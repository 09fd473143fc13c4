import argparse
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import SafeOpenSpy, make_checkpoint, random_pack, tiny_model, write_kimi_vl_folder
from safetensors.torch import load_file, save_file

import moonvit.weights.checkpoint as checkpoint
import moonvit.weights.storage as storage
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
    spy = SafeOpenSpy(monkeypatch, storage)
    loaded = MoonViT.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert spy.opened == {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"}
    assert spy.read == {f"vision_tower.{k}" for k in model.state_dict()}
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert torch.equal(loaded.patch_embed.pos_emb.weight, model.patch_embed.pos_emb.weight.bfloat16())


@pytest.mark.parametrize(("storage", "sharded"), [("safetensors", True), ("bin", True), ("bin", False)])
def test_loading_the_tower_from_a_large_checkpoint_costs_about_the_tower(tmp_path, storage, sharded):
    """A 512 MB language model beside a 1 MB tower: peak memory grows by far less
    than the language model (measured in a fresh process, from its high-water mark), in
    safetensors shards and in torch pickles (memory-mapped), even one file holding both."""
    model = tiny_model()
    lm = {f"language_model.layers.{i}.weight": torch.zeros(4096, 4096) for i in range(8)}  # 8 x 64 MB
    write_kimi_vl_folder(tmp_path, model, other_tensors=lm, sharded=sharded, storage=storage)
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


@pytest.mark.parametrize("sharded", [False, True])
def test_pytorch_model_bin_checkpoints_load_as_safetensors_ones_do(tmp_path, sharded):
    model = tiny_model()
    write_kimi_vl_folder(tmp_path / "bin", model, sharded=sharded, storage="bin", other_tensors=LM_TENSORS)
    loaded = MoonViT.from_pretrained(tmp_path / "bin")
    assert_same_model(model, loaded)
    # a folder with both reads the safetensors files
    write_kimi_vl_folder(tmp_path / "bin", tiny_model(seed=1), sharded=sharded)
    assert_same_model(tiny_model(seed=1), MoonViT.from_pretrained(tmp_path / "bin"))


def test_legacy_and_damaged_torch_files_are_named(tmp_path):
    model = tiny_model()
    write_kimi_vl_folder(tmp_path / "legacy", model, storage="bin-legacy")
    with pytest.warns(UserWarning, match=r"pytorch_model\.bin is in torch's legacy .* read whole"):
        assert_same_model(model, MoonViT.from_pretrained(tmp_path / "legacy"))
    folder = write_kimi_vl_folder(tmp_path / "cut", model, storage="bin")
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read .*pytorch_model\.bin: .*truncated or corrupt torch file"):
        MoonViT.from_pretrained(folder)
    # a training checkpoint pickling more than tensors is not unpickled
    state = {f"vision_tower.{k}": v for k, v in model.state_dict().items()}
    torch.save({**state, "args": argparse.Namespace(lr=1e-3)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin holds objects other than tensors"):
        MoonViT.from_pretrained(folder)
    torch.save({**state, "step": 7}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="holds a dict holding more than tensors, not a flat dict of tensors"):
        MoonViT.from_pretrained(folder)


def test_a_legacy_pickle_is_warned_about_once_per_load(tmp_path):
    """One load reads a legacy pickle for its names and for its tensors: one warning, not three."""
    model = tiny_model()
    write_kimi_vl_folder(tmp_path, model, storage="bin-legacy")
    with pytest.warns(UserWarning) as record:  # records every warning, repeats included
        assert_same_model(model, MoonViT.from_pretrained(tmp_path))
    legacy = [w for w in record if "legacy (pre-1.6) pickle format" in str(w.message)]
    assert len(legacy) == 1, [str(w.message) for w in legacy]


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "a/../../x.safetensors", ""])
def test_index_shard_names_stay_inside_the_folder(tmp_path, shard):
    """An index naming a shard outside its folder is refused before anything is opened."""
    write_kimi_vl_folder(tmp_path / "ckpt", tiny_model(), sharded=True)
    index_path = tmp_path / "ckpt" / storage.INDEX_FILE
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    index_path.write_text(json.dumps(index))
    save_file({"x": torch.zeros(1)}, tmp_path / "outside.safetensors")  # there, to be sure it is not read
    with pytest.raises(CheckpointError, match="names the shard .*not a file inside the checkpoint folder") as error:
        MoonViT.from_pretrained(tmp_path / "ckpt")
    assert str(index_path) in str(error.value) and repr(shard) in str(error.value)


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
    with pytest.raises(CheckpointError, match="has none of model.safetensors, model.safetensors.index.json, pytorch"):
        MoonViT.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="names gone.safetensors"):
        MoonViT.from_pretrained(tmp_path)


# ---- damaged and mismatched checkpoints ---------------------------------------------------------


def truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: truncate(p, lambda n: n // 2),  # cut in the tensor data
        lambda p: truncate(p, lambda n: 20),  # cut in the header
        lambda p: truncate(p, lambda n: 0),  # empty
        lambda p: p.write_bytes(b"garbage" * 100),  # not safetensors at all
    ],
)
def test_a_damaged_tensor_file_is_named(tmp_path, damage):
    from moonvit_projector import MoonViTProjector

    write_kimi_vl_folder(tmp_path, tiny_model(), other_tensors=LM_TENSORS, sharded=True)
    damage(tmp_path / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match=r"cannot read .*model-00002-of-00003\.safetensors.*safetensors"):
        MoonViT.from_pretrained(tmp_path)
    own = make_checkpoint(tmp_path / "own")
    damage(own / "projector.safetensors")
    with pytest.raises(CheckpointError, match=r"cannot read .*own/projector\.safetensors"):
        MoonViTProjector.from_pretrained(own)


def test_a_depth_mismatch_is_one_line(tmp_path):
    write_kimi_vl_folder(tmp_path, tiny_model())
    config = json.loads((tmp_path / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = 27
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        MoonViT.from_pretrained(tmp_path)
    message = str(error.value)
    assert "vision_tower.encoder.blocks: the checkpoint has 2, the config says 27" in message
    assert "missing 300 tensors: vision_tower.encoder.blocks.{2..26}.* (300)" in message  # 12 per block
    assert len(message) < 400 and "\n" not in message


def test_a_depth_mismatch_the_other_way_and_stray_tensors(tmp_path):
    model = tiny_model(num_hidden_layers=3)
    write_kimi_vl_folder(tmp_path, model)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"the checkpoint has 3, the config says 1; unexpected 24 tensors: .*blocks\.\{1\.\.2\}\.\* \(24\)$",
    ):
        MoonViT.from_pretrained(tmp_path)


def test_a_width_mismatch_is_counted_not_listed(tmp_path):
    write_kimi_vl_folder(tmp_path, tiny_model())
    config = json.loads((tmp_path / "config.json").read_text())
    config["vision_config"].update(hidden_size=128, num_attention_heads=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        MoonViT.from_pretrained(tmp_path)
    message = str(error.value)
    assert "tensors of the wrong shape for the config" in message and message.count("expected") == 3
    assert message.endswith("; ...")


def test_unknown_config_keys_are_named(tmp_path):
    model = tiny_model()
    write_kimi_vl_folder(tmp_path, model)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vision_config"].update(num_hiden_layers=4, torch_dtype="bfloat16", mm_projector_type="patchmerger")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=r"config\.json: ignoring keys this package does not read: num_hiden_layers$"):
        assert_same_model(model, MoonViT.from_pretrained(tmp_path))


def test_invalid_config_values_name_the_file(tmp_path):
    MoonViTConfig(hidden_size=64, num_attention_heads=4).save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 5}))
    with pytest.raises(
        CheckpointError, match=r"config\.json: hidden_size 64 is not divisible by num_attention_heads 5"
    ):
        MoonViT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config\.json holds a JSON list, not an object"):
        MoonViT.from_pretrained(tmp_path)


def test_a_file_where_a_folder_is_expected_is_said_so(tmp_path):
    from moonvit_projector import MoonViTProjector

    tiny_model().save_pretrained(tmp_path)
    for load in (MoonViT.from_pretrained, MoonViTProjector.from_pretrained):
        with pytest.raises(CheckpointError, match=r"model\.safetensors is a file, not a folder \(pass the checkpoint"):
            load(tmp_path / "model.safetensors")


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "is not valid JSON"),
        ('["a list"]', "holds a JSON list, not an object"),
        ('{"patch_size": 0}', "patch_size must be a positive int"),
        ('{"image_mean": "grey"}', "image_mean must hold 3 values"),
        (b"\xff\xfe\x00binary", "is not a text file"),
    ],
)
def test_a_broken_preprocessor_config_names_the_file(tmp_path, text, message):
    from moonvit import MoonViTImageProcessor

    file = tmp_path / "preprocessor_config.json"
    file.write_bytes(text) if isinstance(text, bytes) else file.write_text(text)
    for source in (tmp_path, file):
        with pytest.raises(CheckpointError, match=rf"preprocessor_config\.json.*{message}"):
            MoonViTImageProcessor.from_pretrained(source)


def test_unknown_preprocessor_keys_are_named(tmp_path):
    from moonvit import MoonViTImageProcessor

    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"in_patch_limit": 16384, "num_pooled_tokens": 1024, "image_processor_type": "X", "patch_size": 14})
    )
    with pytest.warns(UserWarning, match=r"ignoring keys this package does not read: in_patch_limit$"):
        MoonViTImageProcessor.from_pretrained(tmp_path)


def test_warnings_of_a_command_line_are_one_line(tmp_path):
    """A loader's warning, printed by a command line: one line, no source line."""
    from PIL import Image

    model = tiny_model()
    model.save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "vt_extra": 1}))
    Image.new("RGB", (28, 28)).save(tmp_path / "a.png")
    command = [
        sys.executable,
        "-m",
        "moonvit",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--images",
        str(tmp_path / "a.png"),
    ]
    result = subprocess.run([*command, "--out", str(tmp_path / "out")], capture_output=True, text=True, check=True)
    assert result.stderr.splitlines() == [
        f"warning: {tmp_path / 'ckpt' / 'config.json'}: ignoring keys this package does not read: vt_extra"
    ]
