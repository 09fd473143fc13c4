"""The projector: its math against a plain reference and transformers' Kimi-K2.5
projection, and its checkpoints (own format, Kimi-VL, Kimi-K2.5)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import SafeOpenSpy, random_pack, randomize_, tiny_model, write_kimi_vl_folder
from safetensors.torch import load_file, save_file

import moonvit.weights.storage as storage
from moonvit import CheckpointError, MoonViT
from moonvit_projector import MoonViTProjector, ProjectorConfig

D, TEXT = 64, 48  # the tiny encoder's width; a small LLM width


def tiny_projector(projector_type="kimi", seed=0, dtype=torch.float32):
    """Non-trivial weights: LayerNorm weights around 1.5, nonzero biases."""
    config = ProjectorConfig(projector_type=projector_type, vision_hidden_size=D, text_hidden_size=TEXT)
    return randomize_(MoonViTProjector(config), seed).to(dtype).eval()


def random_merged(n=10, seed=0, dtype=torch.float64):
    """(n, 4, D) merged groups whose patches have different scales and offsets."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, D, generator=gen, dtype=torch.float64)
    return (x * torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)[:, None] + 0.3).to(dtype)


def erf_gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def reference_kimi(state, merged, eps=1e-5):
    """Kimi-VL's projector as published: per-patch LayerNorm, concat, linear, erf GELU, linear."""
    x = F.layer_norm(merged, (merged.shape[-1],), state["pre_norm.weight"], state["pre_norm.bias"], eps)
    x = x.reshape(merged.shape[0], -1)
    x = erf_gelu(x @ state["linear_1.weight"].T + state["linear_1.bias"])
    return x @ state["linear_2.weight"].T + state["linear_2.bias"]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- the math -------------------------------------------------------------------------


def test_kimi_projects_encoder_output_like_the_reference():
    encoder = tiny_model(dtype=torch.float64)
    projector = tiny_projector(dtype=torch.float64)
    pixels, grids = random_pack([(2, 2), (4, 6)], dtype=torch.float64)
    merged = encoder(pixels, grids).merged
    out = projector(merged)
    assert out.shape == (1 + 6, TEXT) and out.dtype == torch.float64
    torch.testing.assert_close(out, reference_kimi(projector.state_dict(), merged), rtol=1e-12, atol=1e-12)


def test_layer_norm_is_per_patch_before_the_concat():
    """With eps 0, rescaling one patch of each group leaves a per-patch LayerNorm's
    output unchanged; a LayerNorm over the concatenated 4D features would change."""
    config = ProjectorConfig(vision_hidden_size=D, text_hidden_size=TEXT, layer_norm_eps=0.0)
    projector = randomize_(MoonViTProjector(config)).double()
    merged = random_merged()
    rescaled = merged.clone()
    rescaled[:, 2] *= 7.0
    torch.testing.assert_close(projector(rescaled), projector(merged), rtol=1e-12, atol=1e-12)


def test_mlp2x_gelu_is_linear_gelu_linear_on_the_flattened_token():
    projector = tiny_projector("mlp2x_gelu", dtype=torch.float64)
    shapes = {name: tuple(t.shape) for name, t in projector.state_dict().items()}
    assert shapes == {
        "linear_1.weight": (TEXT, 4 * D),
        "linear_1.bias": (TEXT,),
        "linear_2.weight": (TEXT, TEXT),
        "linear_2.bias": (TEXT,),
    }
    merged = random_merged()
    s = projector.state_dict()
    hidden = erf_gelu(merged.flatten(1) @ s["linear_1.weight"].T + s["linear_1.bias"])
    torch.testing.assert_close(projector(merged), hidden @ s["linear_2.weight"].T + s["linear_2.bias"])


def test_leading_dimensions_and_dtype_cast():
    projector = tiny_projector()
    merged = random_merged(6)
    out = projector(merged.reshape(2, 3, 4, D))  # float64 in, cast to the projector's float32
    assert out.shape == (2, 3, TEXT) and out.dtype == torch.float32
    torch.testing.assert_close(out.reshape(6, TEXT), projector(merged.float()))


def test_input_errors_are_clear():
    projector = tiny_projector()
    with pytest.raises(ValueError, match=r"expects merged patch groups of shape \(\.\.\., 4, 64\).*got \(40, 64\)"):
        projector(torch.randn(40, D))  # last_hidden_state instead of merged
    with pytest.raises(ValueError, match=r"got \(10, 4, 32\)"):
        projector(torch.randn(10, 4, 32))
    with pytest.raises(TypeError, match="must be floating"):
        projector(torch.ones(10, 4, D, dtype=torch.long))


def test_config_validation_and_for_encoder():
    with pytest.raises(ValueError, match="projector_type must be one of"):
        ProjectorConfig(projector_type="linear")
    config = ProjectorConfig.for_encoder(MoonViT.from_preset("tiny").config, 32, projector_type="mlp2x_gelu")
    assert (config.vision_hidden_size, config.merge_kernel_size, config.text_hidden_size) == (64, (2, 2), 32)
    assert config.intermediate_size == 32 and ProjectorConfig().intermediate_size == 4608


# ---- parity with transformers -------------------------------------------------------

kimi_k25 = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config


def to_transformers(projector):
    """transformers' Kimi_K25MultimodalProjection with our weights (pre_norm, in_proj, out_proj)."""
    c = projector.config
    config = Kimi_K25Config(
        vision_config=dict(
            hidden_size=c.vision_hidden_size,
            merge_kernel_size=list(c.merge_kernel_size),
            num_attention_heads=4,
            intermediate_size=128,
            num_hidden_layers=1,
        ),
        text_config=dict(hidden_size=c.text_hidden_size),
        projection_hidden_size=c.vision_hidden_size,
        projection_layer_norm_eps=c.layer_norm_eps,
    )
    theirs = kimi_k25.Kimi_K25MultimodalProjection(config)
    renames = {"pre_norm": "pre_norm", "linear_1": "in_proj", "linear_2": "out_proj"}
    state = {renames[k.split(".")[0]] + "." + k.split(".")[1]: v for k, v in projector.state_dict().items()}
    theirs.load_state_dict(state, strict=True)
    return theirs.to(projector.dtype).eval()


def run_transformers(theirs, merged):
    return theirs(merged).squeeze(1)  # (N, 1, text) -> (N, text)


def test_float64_parity_with_transformers():
    projector = tiny_projector(seed=1, dtype=torch.float64)
    merged = random_merged(12, seed=1)
    with torch.no_grad():
        assert (projector(merged) - run_transformers(to_transformers(projector), merged)).abs().max() < 1e-10


def test_bfloat16_as_close_to_exact_as_transformers():
    """bf16 keeps 8 significant bits (unit roundoff 2^-9 = 0.002): a LayerNorm, two
    4D-long dot products and a GELU, each rounded, end up ~0.5% from the exact answer
    for unit-scale weights. Our bf16 output must be no further from float64 than
    transformers' bf16 output (with 25% slack for rounding luck), and within 1%."""
    exact = tiny_projector(seed=2, dtype=torch.float64)
    merged = random_merged(64, seed=2)
    with torch.no_grad():
        reference = exact(merged)
        model = tiny_projector(seed=2, dtype=torch.bfloat16)
        ours = model(merged.bfloat16())
        theirs = run_transformers(to_transformers(model), merged.bfloat16())
    ours_error, theirs_error = rel(ours, reference), rel(theirs, reference)
    assert ours_error <= 1.25 * theirs_error + 1e-4
    assert ours_error < 0.01
    assert rel(ours, theirs) < 0.01


# ---- checkpoints -----------------------------------------------------------------------


def assert_same_projector(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert a.config == b.config


@pytest.mark.parametrize("projector_type", ["kimi", "mlp2x_gelu"])
def test_own_format_round_trips_exactly(tmp_path, projector_type):
    projector = tiny_projector(projector_type)
    projector.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"projector_config.json", "projector.safetensors"}
    assert json.loads((tmp_path / "projector_config.json").read_text())["projector_type"] == projector_type
    loaded = MoonViTProjector.from_pretrained(tmp_path)
    assert_same_projector(projector, loaded)
    assert not loaded.training
    merged = random_merged(dtype=torch.float32)
    assert torch.equal(loaded(merged), projector(merged))


def test_encoder_and_projector_share_one_folder(tmp_path):
    encoder, projector = tiny_model(), tiny_projector()
    encoder.save_pretrained(tmp_path)
    projector.save_pretrained(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"config.json", "model.safetensors", "projector_config.json", "projector.safetensors"}
    assert_same_projector(projector, MoonViTProjector.from_pretrained(tmp_path))
    assert set(MoonViT.from_pretrained(tmp_path).state_dict()) == set(encoder.state_dict())


def kimi_vl_tensors(projector):
    return {f"multi_modal_projector.{k}": v for k, v in projector.state_dict().items()}


LM_TENSORS = {
    "language_model.model.embed_tokens.weight": torch.randn(100, TEXT),
    "language_model.lm_head.weight": torch.randn(100, TEXT),
}


def test_kimi_vl_single_file(tmp_path):
    projector = tiny_projector()
    other = LM_TENSORS | kimi_vl_tensors(projector)
    write_kimi_vl_folder(tmp_path, tiny_model(), text_hidden_size=TEXT, other_tensors=other)
    assert_same_projector(projector, MoonViTProjector.from_pretrained(tmp_path))


def test_kimi_vl_sharded_reads_only_projector_tensors(tmp_path, monkeypatch):
    projector = tiny_projector()
    # Shard 1: vision + the embedding table; shard 2: vision; shard 3: lm_head + projector.
    other = LM_TENSORS | kimi_vl_tensors(projector)
    write_kimi_vl_folder(tmp_path, tiny_model(), text_hidden_size=TEXT, other_tensors=other, sharded=True)
    spy = SafeOpenSpy(monkeypatch, storage)
    loaded = MoonViTProjector.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert spy.opened == {"model-00003-of-00003.safetensors"}
    assert spy.read == set(kimi_vl_tensors(projector))
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert torch.equal(loaded.linear_1.weight, projector.linear_1.weight.bfloat16())


def write_kimi_k25_folder(folder, projector):
    """Kimi-K2.5's remote-code layout: vt_* vision fields, mm_projector.proj.{0,2} names."""
    config = {
        "model_type": "kimi_k25",
        "vision_config": {
            "vt_hidden_size": D,
            "mm_hidden_size": D,
            "merge_kernel_size": [2, 2],
            "mm_projector_type": "patchmerger",
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-5,
            "text_hidden_size": TEXT,
        },
        "text_config": {"model_type": "kimi_k2", "hidden_size": TEXT},
    }
    (folder / "config.json").write_text(json.dumps(config))
    names = {"pre_norm": "pre_norm", "linear_1": "proj.0", "linear_2": "proj.2"}
    tensors = {f"mm_projector.{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in projector.state_dict().items()}
    tensors["vision_tower.patch_embed.proj.bias"] = torch.zeros(D)
    save_file(tensors | LM_TENSORS, folder / "model.safetensors")
    return folder


def test_kimi_k25_names(tmp_path):
    projector = tiny_projector()
    loaded = MoonViTProjector.from_pretrained(write_kimi_k25_folder(tmp_path, projector))
    assert_same_projector(projector, loaded)


def test_dtype_and_device(tmp_path):
    tiny_projector().save_pretrained(tmp_path)
    loaded = MoonViTProjector.from_pretrained(tmp_path, dtype=torch.float64, device="cpu")
    assert loaded.dtype == torch.float64 and loaded.device.type == "cpu"


def broken_kimi_vl(tmp_path, edit):
    tensors = kimi_vl_tensors(tiny_projector())
    edit(tensors)
    write_kimi_vl_folder(tmp_path, tiny_model(), text_hidden_size=TEXT, other_tensors=tensors)
    return tmp_path


def test_missing_tensor_is_named(tmp_path):
    folder = broken_kimi_vl(tmp_path, lambda t: t.pop("multi_modal_projector.linear_2.bias"))
    with pytest.raises(CheckpointError, match=r"missing \['multi_modal_projector.linear_2.bias'\]$"):
        MoonViTProjector.from_pretrained(folder)


def test_unexpected_tensor_is_named(tmp_path):
    folder = broken_kimi_vl(tmp_path, lambda t: t.update({"multi_modal_projector.linear_3.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected \['multi_modal_projector.linear_3.weight'\]"):
        MoonViTProjector.from_pretrained(folder)


def test_wrong_shape_is_named(tmp_path):
    """A projector for another LLM width: the config says 48, the tensors say 32."""
    folder = broken_kimi_vl(tmp_path, lambda t: t.update({"multi_modal_projector.linear_2.bias": torch.zeros(32)}))
    with pytest.raises(CheckpointError, match=r"multi_modal_projector.linear_2.bias: \(32,\), expected \(48,\)"):
        MoonViTProjector.from_pretrained(folder)


def test_own_format_errors_name_the_tensors(tmp_path):
    tiny_projector().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "projector.safetensors")
    tensors["linear_1.weight"] = torch.zeros(3, 3)
    save_file(tensors, tmp_path / "projector.safetensors")
    with pytest.raises(CheckpointError, match=r"linear_1.weight: \(3, 3\), expected \(256, 256\)"):
        MoonViTProjector.from_pretrained(tmp_path)
    (tmp_path / "projector.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has projector_config.json but no projector.safetensors"):
        MoonViTProjector.from_pretrained(tmp_path)


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        MoonViTProjector.from_pretrained(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="neither projector_config.json nor config.json"):
        MoonViTProjector.from_pretrained(tmp_path)
    tiny_model().save_pretrained(tmp_path)  # an encoder alone: config.json without text_config
    with pytest.raises(CheckpointError, match="no vision_config and text_config"):
        MoonViTProjector.from_pretrained(tmp_path)


def test_kimi_folder_without_projector_or_with_an_unsupported_one(tmp_path):
    write_kimi_vl_folder(tmp_path / "vl", tiny_model(), text_hidden_size=TEXT, other_tensors=LM_TENSORS)
    with pytest.raises(CheckpointError, match=r"holds no projector tensors \(multi_modal_projector\.\*.*mm_projector"):
        MoonViTProjector.from_pretrained(tmp_path / "vl")
    folder = write_kimi_k25_folder(tmp_path, tiny_projector())
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["mm_projector_type"] = "patchmergerv3"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported projector.*'patchmergerv3'"):
        MoonViTProjector.from_pretrained(folder)
