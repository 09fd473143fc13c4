"""llama.cpp's mmproj GGUF: what export_gguf writes, that its RoPE layout is llama.cpp's, and (where
llama.cpp's source or llama-cpp-python are found) that it equals the converter's file and runs in
llama.cpp to this package's tokens.

The last two need llama.cpp itself: ``LLAMA_CPP_DIR`` naming a llama.cpp source tree (for
``convert_hf_to_gguf.py``) and ``llama_cpp`` importable with ``mtmd``; ``pytest -m llamacpp`` runs
them, and ``python benchmarks/llamacpp_check.py`` prints the per-image errors and timings.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import randomize_, tiny_k3_model, tiny_k3_projector, write_k25_release_folder, write_kimi_vl_folder
from PIL import Image

from moonvit import MoonViT, MoonViTImageProcessor, preset_config, tokens_per_image
from moonvit.gguf import export_gguf, split_half_rope_rows
from moonvit.gguf.__main__ import main as gguf_main
from moonvit.model.rope import apply_rope, rope_rotation
from moonvit_projector import MoonViTProjector, ProjectorConfig

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from llamacpp import (
    LlamaCppVision,
    gguf_differences,
    llama_cpp_available,
    read_gguf,
    run_converter,
    write_text_stub,
)

TEXT = 48


def tower(heads: int = 4, width: int = 64, time: int = 4, depth: int = 2, seed: int = 0) -> MoonViT:
    config = preset_config(
        "tiny", num_attention_heads=heads, hidden_size=width, init_pos_emb_time=time, num_hidden_layers=depth
    )
    return randomize_(MoonViT(config), seed).eval()


def kimi_projector(encoder: MoonViT, seed: int = 1) -> MoonViTProjector:
    return randomize_(MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, TEXT)), seed).eval()


# ---- the file ------------------------------------------------------------------------------------------


def test_a_k25_tower_as_kimik25_has_the_keys_names_and_dtypes_llama_cpp_reads(tmp_path):
    encoder, processor = tower(), MoonViTImageProcessor.kimi_k25()
    projector = kimi_projector(encoder)
    summary = export_gguf(encoder, projector, processor, tmp_path / "a.gguf", dtype="f16", name="tiny")
    keys, tensors = read_gguf(summary.path)
    assert keys["general.architecture"] == "clip" and keys["general.type"] == "mmproj"
    assert keys["clip.projector_type"] == "kimik25" and keys["general.file_type"] == 1
    assert (keys["clip.vision.block_count"], keys["clip.vision.embedding_length"]) == (2, 64)
    assert keys["clip.vision.attention.head_count"] == 4 and keys["clip.vision.projection_dim"] == TEXT
    assert keys["clip.vision.image_max_pixels"] == 16384 * 196 and keys["clip.vision.image_min_pixels"] == 8 * 196
    assert keys["clip.vision.image_mean"] == [0.5, 0.5, 0.5] and keys["vision.pos_emb_time"] == 4
    assert len(tensors) == summary.tensors == 5 + 2 * 12 + 6
    types = {name: kind for name, (kind, _, _) in tensors.items()}
    assert types["v.patch_embd.weight"] == "F16" and types["v.blk.0.attn_qkv.weight"] == "F16"
    assert types["v.position_embd.weight"] == "F32" and types["v.blk.1.ln1.weight"] == "F32"
    assert types["mm.input_norm.weight"] == "F32" and types["mm.1.bias"] == "F32" and types["mm.2.weight"] == "F16"
    assert tensors["v.position_embd.weight"][1] == [64, 64, 64]  # (H, W, D), the GGUF dimensions reversed
    assert tensors["v.patch_embd.weight"][1] == [14, 14, 3, 64]
    # the fused qkv: q and k permuted to split halves, v as it is
    wqkv = encoder.encoder.blocks[0].wqkv.weight.detach()
    stored = torch.from_numpy(tensors["v.blk.0.attn_qkv.weight"][2].astype(np.float32))
    q, k, v = wqkv.chunk(3)
    expected = torch.cat([split_half_rope_rows(q, 4), split_half_rope_rows(k, 4), v]).half().float()
    assert torch.equal(stored, expected)


@pytest.mark.parametrize("dtype, matrix", [("f32", "F32"), ("bf16", "BF16")])
def test_dtypes_follow_llama_cpp_s_converter(tmp_path, dtype, matrix):
    encoder = tower(time=0)
    path = export_gguf(encoder, kimi_projector(encoder), MoonViTImageProcessor(), tmp_path / "a.gguf", dtype=dtype).path
    types = {name: kind for name, (kind, _, _) in read_gguf(path)[1].items()}
    assert types["v.blk.0.ffn_down.weight"] == matrix and types["mm.1.weight"] == matrix
    assert types["v.patch_embd.weight"] == "F32"  # F16 only in an F16 file
    assert types["v.blk.0.ffn_down.bias"] == "F32" and types["v.post_ln.weight"] == "F32"


BLOCK_NAMES = {"ln1": "norm0", "ln2": "norm1", "attn_out": "wo", "ffn_up": "mlp.fc0", "ffn_down": "mlp.fc1"}
PROJECTOR_NAMES = {"mm.input_norm": "pre_norm", "mm.1": "linear_1", "mm.2": "linear_2"}


def kimik25_tensors(encoder: MoonViT, projector: MoonViTProjector) -> dict[str, torch.Tensor]:
    """Every tensor a kimik25 file holds, by GGUF name, as the model holds it (float32, torch's
    dimension order), written out here independently of the exporter."""
    state = {name: t.detach().float() for name, t in encoder.state_dict().items()}
    heads = encoder.config.num_attention_heads
    out = {
        "v.patch_embd.weight": state["patch_embed.proj.weight"],
        "v.patch_embd.bias": state["patch_embed.proj.bias"],
        "v.position_embd.weight": state["patch_embed.pos_emb.weight"],
        "v.post_ln.weight": state["encoder.final_layernorm.weight"],
        "v.post_ln.bias": state["encoder.final_layernorm.bias"],
    }
    for i in range(encoder.config.num_hidden_layers):
        for kind in ("weight", "bias"):
            for theirs, ours in BLOCK_NAMES.items():
                out[f"v.blk.{i}.{theirs}.{kind}"] = state[f"encoder.blocks.{i}.{ours}.{kind}"]
            q, k, v = state[f"encoder.blocks.{i}.wqkv.{kind}"].chunk(3)
            out[f"v.blk.{i}.attn_qkv.{kind}"] = torch.cat(
                [split_half_rope_rows(q, heads), split_half_rope_rows(k, heads), v]
            )
    p = {name: t.detach().float() for name, t in projector.state_dict().items()}
    for theirs, ours in PROJECTOR_NAMES.items():
        for kind in ("weight", "bias"):
            out[f"{theirs}.{kind}"] = p[f"{ours}.{kind}"]
    return out


def stored_and_expected(kind: str, data: np.ndarray, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor's data as the file holds it and ``weight`` rounded as the file's GGML type rounds it:
    bf16 compared bit for bit (numpy has no bf16), f16 and f32 as values."""
    if kind == "BF16":
        return torch.from_numpy(data.view(np.int16).reshape(weight.shape)), weight.bfloat16().view(torch.int16)
    if kind == "F16":
        return torch.from_numpy(data.astype(np.float32).reshape(weight.shape)), weight.half().float()
    assert kind == "F32"
    return torch.from_numpy(data.reshape(weight.shape)), weight


def layout_problems(path: Path) -> list[str]:
    """Where the file's tensor offsets disagree with the sizes its header gives them, as llama.cpp's
    ``gguf_init_from_reader`` computes them: each tensor at the previous one's end (padded to the
    alignment) and the data ending with the file."""
    reader = gguf.GGUFReader(path)
    problems, expected = [], 0
    for tensor in reader.tensors:
        block, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        nbytes = int(tensor.n_elements) // block * size
        offset = int(tensor.data_offset) - reader.data_offset
        if offset != expected:
            problems.append(f"{tensor.name} at {offset}, expected at {expected}")
        expected = offset + -(-nbytes // reader.alignment) * reader.alignment
    if reader.data_offset + expected != path.stat().st_size:
        problems.append(f"tensor data ends at {reader.data_offset + expected}, the file at {path.stat().st_size}")
    return problems


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_every_tensor_reads_back_with_the_model_s_shape_and_values(tmp_path, dtype):
    """Written by the command line from a release folder and read back with the gguf package: every
    tensor's shape is the model's (GGUF lists dimensions innermost first), its data the weight
    rounded to its type, and the offsets add up as llama.cpp reads them."""
    encoder = tower()
    projector = kimi_projector(encoder)
    folder = write_k25_release_folder(tmp_path / "k25", encoder, projector, processor=MoonViTImageProcessor.kimi_k25())
    path = tmp_path / "m.gguf"
    gguf_main(["--checkpoint", str(folder), "--out", str(path), "--dtype", dtype])
    expected = kimik25_tensors(encoder, projector)
    reader = gguf.GGUFReader(path)
    assert sorted(t.name for t in reader.tensors) == sorted(expected)
    for tensor in reader.tensors:
        weight = expected[tensor.name]
        assert [int(n) for n in tensor.shape] == list(reversed(weight.shape)), tensor.name
        stored, rounded = stored_and_expected(tensor.tensor_type.name, np.array(tensor.data), weight)
        assert torch.equal(stored, rounded), tensor.name
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["v.blk.0.attn_out.weight"] == kinds["mm.2.weight"] == dtype.upper()
    assert layout_problems(path) == []


def test_a_kimi_vl_tower_as_kimivl_is_split_and_not_permuted(tmp_path):
    encoder = tower(time=0)
    keys, tensors = read_gguf(
        export_gguf(
            encoder, kimi_projector(encoder), MoonViTImageProcessor(), tmp_path / "a.gguf", projector_type="kimivl"
        ).path
    )
    assert keys["clip.projector_type"] == "kimivl" and "vision.pos_emb_height" not in keys
    assert "v.blk.0.attn_qkv.weight" not in tensors and tensors["v.position_embd.weight"][1] == [64, 4096]
    q = encoder.encoder.blocks[1].wqkv.weight.detach().chunk(3)[0]
    assert np.array_equal(tensors["v.blk.1.attn_q.weight"][2], q.numpy())


def test_the_permuted_rows_rotate_as_llama_cpp_rotates_split_halves():
    """Independent of the exporter: llama.cpp's 2D RoPE turns the first half of each head by the
    column and the second half by the row (pairs of adjacent channels, ggml's normal mode). Rotating
    the permuted q that way equals permuting this package's rotated q, so attention scores agree."""
    heads, head_dim, rows = 3, 16, 10
    q = torch.randn(rows, heads * head_dim, dtype=torch.float64)
    positions = torch.stack([torch.arange(rows) // 4, torch.arange(rows) % 4], dim=1)  # (row, col)
    ours = apply_rope(q.view(rows, heads, head_dim), rope_rotation(positions, head_dim, 10000.0)).reshape(rows, -1)

    def llama_cpp_rope(x: torch.Tensor) -> torch.Tensor:
        half = head_dim // 2
        out = x.view(rows, heads, head_dim).clone()
        for part, position in ((slice(0, half), positions[:, 1]), (slice(half, head_dim), positions[:, 0])):
            pairs = out[:, :, part].unflatten(-1, (-1, 2))
            theta = 10000.0 ** (-2 * torch.arange(half // 2, dtype=torch.float64) / half)
            angle = position[:, None, None].double() * theta
            a, b = pairs.unbind(-1)
            out[:, :, part] = torch.stack(
                [a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1
            ).flatten(-2)
        return out.reshape(rows, -1)

    permuted = split_half_rope_rows(q.T, heads).T
    torch.testing.assert_close(llama_cpp_rope(permuted), split_half_rope_rows(ours.T, heads).T, rtol=1e-6, atol=1e-6)


def test_what_llama_cpp_cannot_run_is_refused(tmp_path):
    k3 = tiny_k3_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="Kimi K3's tower .* is not in llama.cpp yet"):
        export_gguf(k3, tiny_k3_projector(k3), MoonViTImageProcessor(), tmp_path / "a.gguf")
    encoder = tower()
    llava = MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, TEXT, projector_type="mlp2x_gelu"))
    with pytest.raises(ValueError, match="this one is 'mlp2x_gelu'"):
        export_gguf(encoder, llava, MoonViTImageProcessor(), tmp_path / "a.gguf")
    with pytest.raises(ValueError, match="exported as 'kimik25'"):
        export_gguf(
            encoder, kimi_projector(encoder), MoonViTImageProcessor(), tmp_path / "a.gguf", projector_type="kimivl"
        )
    with pytest.raises(ValueError, match="block quantisation does not fit"):
        export_gguf(encoder, kimi_projector(encoder), MoonViTImageProcessor(), tmp_path / "a.gguf", dtype="q8_0")
    assert not (tmp_path / "a.gguf").exists()


def eps_tower_and_projector(tower_eps: float, projector_eps: float, time: int) -> tuple[MoonViT, MoonViTProjector]:
    config = preset_config("tiny", hidden_size=64, init_pos_emb_time=time, layer_norm_eps=tower_eps)
    encoder = MoonViT(config).eval()
    return encoder, MoonViTProjector(ProjectorConfig.for_encoder(config, TEXT, layer_norm_eps=projector_eps))


def test_a_layer_norm_eps_llama_cpp_s_graph_would_not_use_is_refused(tmp_path):
    """kimik25's graph takes one eps (the file's) for the tower's norms and the projector's pre-norm;
    kimivl's takes the file's for the tower and 1e-5 for the projector, whatever the file says."""
    path = tmp_path / "a.gguf"
    encoder, projector = eps_tower_and_projector(1e-6, 1e-5, time=4)
    with pytest.raises(ValueError, match=r"tower's LayerNorm eps \(1e-06\).*projector's \(1e-05\)"):
        export_gguf(encoder, projector, MoonViTImageProcessor(), path)
    encoder, projector = eps_tower_and_projector(1e-5, 1e-6, time=0)
    with pytest.raises(ValueError, match=r"projector's LayerNorm eps \(1e-06\).*1e-05"):
        export_gguf(encoder, projector, MoonViTImageProcessor(), path, projector_type="kimivl")
    assert not path.exists()
    for projector_type, time in (("kimik25", 4), ("kimivl", 0)):
        encoder, projector = eps_tower_and_projector(1e-6, 1e-6 if projector_type == "kimik25" else 1e-5, time)
        export_gguf(encoder, projector, MoonViTImageProcessor(), path, projector_type=projector_type)
        eps = read_gguf(path)[0]["clip.vision.attention.layer_norm_epsilon"]
        assert eps == pytest.approx(1e-6, rel=1e-6), projector_type  # the tower's, stored as float32


def test_the_command_line_exports_a_release_folder(tmp_path, capsys):
    encoder = tower()
    processor = MoonViTImageProcessor.kimi_k25()
    folder = write_k25_release_folder(tmp_path / "k25", encoder, kimi_projector(encoder), processor=processor)
    gguf_main(["--checkpoint", str(folder), "--out", str(tmp_path / "m.gguf"), "--dtype", "f16"])
    assert "kimik25, f16, 35 tensors" in capsys.readouterr().out
    keys, _ = read_gguf(tmp_path / "m.gguf")
    assert keys["general.name"] == "k25" and keys["clip.vision.image_max_pixels"] == 16384 * 196
    with pytest.raises(SystemExit) as error:
        gguf_main(["--checkpoint", str(folder), "--out", str(tmp_path / "v.gguf"), "--projector-type", "kimivl"])
    assert error.value.code == 1 and "exported as 'kimik25'" in capsys.readouterr().err


def test_a_checkpoint_without_a_projector_is_told_how_to_attach_one(tmp_path, capsys):
    """A tower saved by this package (as training saves one) has no projector: the error names what is
    missing and both ways to attach one, and each way then exports."""
    encoder = tower()
    encoder.save_pretrained(tmp_path / "trained")
    MoonViTImageProcessor().save_pretrained(tmp_path / "trained")
    out = str(tmp_path / "m.gguf")
    with pytest.raises(SystemExit) as error:
        gguf_main(["--checkpoint", str(tmp_path / "trained"), "--out", out])
    message = capsys.readouterr().err
    assert error.value.code == 1 and "no Kimi projector" in message
    assert "--projector-from" in message and "MoonViTProjector(...).save_pretrained" in message
    kimi_projector(encoder).save_pretrained(tmp_path / "projector")
    trained, other = str(tmp_path / "trained"), str(tmp_path / "projector")
    gguf_main(["--checkpoint", trained, "--projector-from", other, "--out", out])
    assert "kimik25, f32, 35 tensors" in capsys.readouterr().out
    kimi_projector(encoder).save_pretrained(tmp_path / "trained")
    gguf_main(["--checkpoint", str(tmp_path / "trained"), "--out", out])
    assert "kimik25, f32, 35 tensors" in capsys.readouterr().out


def test_the_dtype_choices_are_llama_cpp_s_names_in_help_errors_and_the_docs(capsys):
    from moonvit.gguf.__main__ import build_parser

    help_text = build_parser().format_help()
    assert "--dtype {f32,f16,bf16}" in help_text
    docs = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    assert "python -m moonvit.gguf --checkpoint DIR_OR_HUB_ID --out mmproj.gguf [--dtype f32|f16|bf16]" in docs
    for spelling, name in (("f16", "f16"), ("fp16", "f16"), ("float32", "f32"), ("BF16", "bf16")):
        assert build_parser().parse_args(["--checkpoint", ".", "--out", "m.gguf", "--dtype", spelling]).dtype == name
    for refused in ("int8", "q8_0", "fp64"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--checkpoint", ".", "--out", "m.gguf", "--dtype", refused])
        message = capsys.readouterr().err
        assert "choose from f32, f16, bf16" in message and "fp64" not in message.replace(refused, ""), message


# ---- against llama.cpp itself ------------------------------------------------------------------------

LLAMA_CPP_DIR = os.environ.get("LLAMA_CPP_DIR")
needs_converter = pytest.mark.skipif(
    not LLAMA_CPP_DIR or not (Path(LLAMA_CPP_DIR) / "convert_hf_to_gguf.py").is_file(),
    reason="LLAMA_CPP_DIR (a llama.cpp source tree with convert_hf_to_gguf.py) is not set",
)


@pytest.mark.llamacpp
@needs_converter
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("family", ["k25", "kimivl"])
def test_the_file_is_the_converters_tensor_for_tensor(tmp_path, family, outtype):
    """16 heads: the converter permutes K2.5's q / k rows with num_attention_heads, which a K2.5
    config.json does not hold (its key is vt_num_attention_heads), so it always takes 16. 3 blocks:
    its name map covers ``mm.{i}`` only for i below the block count."""
    encoder = tower(heads=16, width=128, time=4 if family == "k25" else 0, depth=3)
    projector = kimi_projector(encoder)
    if family == "k25":
        processor, kind = MoonViTImageProcessor.kimi_k25(), "kimik25"
        folder = write_k25_release_folder(tmp_path / "release", encoder, projector, processor=processor)
    else:
        p = projector.state_dict()
        other = {f"multi_modal_projector.{k}": v for k, v in p.items()}
        folder = write_kimi_vl_folder(tmp_path / "release", encoder, text_hidden_size=TEXT, other_tensors=other)
        processor, kind = MoonViTImageProcessor(), "kimivl"
        processor.save_pretrained(folder)
    assert LLAMA_CPP_DIR is not None
    run_converter(Path(LLAMA_CPP_DIR), folder, tmp_path / "theirs.gguf", outtype)
    export_gguf(encoder, projector, processor, tmp_path / "ours.gguf", dtype=outtype, projector_type=kind)
    assert gguf_differences(tmp_path / "ours.gguf", tmp_path / "theirs.gguf") == []


needs_mtmd = pytest.mark.skipif(llama_cpp_available() is not None, reason=str(llama_cpp_available()))


@pytest.mark.llamacpp
@needs_mtmd
@pytest.mark.parametrize("family", ["k25", "kimi-vl"])
def test_llama_cpp_computes_this_package_s_tokens_from_the_file(tmp_path, family):
    """llama.cpp's own kimik25 graph on the exported file: the same tokens, and as many, for images
    whose sides are multiples of 28 (where its preprocessing and Kimi's agree).

    The bound is llama.cpp's float error, not the file's: in an f32 file its graph still rounds
    each GELU input to float16 (ggml's GELU lookup table, ``GGML_GELU_FP16`` in ggml-cpu/vec.h) and,
    with flash attention (on by default on CPU), casts K and V to float16. Measured here: 5e-4
    without flash attention, 8e-4 with; the Kimi-VL converter's layout gives 0.2-0.6."""
    encoder = tower(heads=4, width=64, time=4 if family == "k25" else 0, depth=3).double()
    projector = kimi_projector(encoder).double()
    processor = MoonViTImageProcessor.kimi_k25() if family == "k25" else MoonViTImageProcessor()
    path = export_gguf(encoder, projector, processor, tmp_path / "m.gguf", dtype="f32").path
    stub = write_text_stub(tmp_path / "text.gguf", TEXT)
    rng = np.random.default_rng(0)
    with LlamaCppVision(path, stub, threads=2) as llama:
        for height, width in [(56, 56), (112, 196), (252, 84)]:
            image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            batch = processor(Image.fromarray(image))
            with torch.no_grad():
                merged = encoder(batch.pixel_values.double(), batch.grid_hws).merged
                ours = projector(merged).float().numpy()
            theirs, _ = llama.encode(image)
            assert theirs.shape == ours.shape == (tokens_per_image(batch.grid_hws, (2, 2))[0], TEXT)
            error = np.linalg.norm(theirs - ours) / np.linalg.norm(ours)
            assert error < 2e-3, (height, width, error)


# ggml's CPU matmul rounds the activations to the weights' type as well; rounding both the weights
# and every linear's input that way moves this tower's tokens by 8.7e-4 (f16) and 6.7e-3 (bf16)
# in float64, on top of llama.cpp's own float error in an f32 file (see the test above).
DTYPE_BOUNDS = {"f32": 2e-3, "f16": 5e-3, "bf16": 3e-2}


@pytest.mark.llamacpp
@needs_mtmd
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_llama_cpp_loads_every_dtype(tmp_path, dtype):
    """Each dtype's file is read by llama.cpp's loader (which checks every tensor's offset against
    the size its header gives it) and computes this package's tokens to the dtype's rounding."""
    encoder = tower(heads=4, width=64, time=4, depth=3).double()
    projector = kimi_projector(encoder).double()
    processor = MoonViTImageProcessor.kimi_k25()
    path = export_gguf(encoder, projector, processor, tmp_path / "m.gguf", dtype=dtype).path
    image = np.random.default_rng(0).integers(0, 256, (56, 112, 3), dtype=np.uint8)
    batch = processor(Image.fromarray(image))
    with torch.no_grad():
        ours = projector(encoder(batch.pixel_values.double(), batch.grid_hws).merged).float().numpy()
    with LlamaCppVision(path, write_text_stub(tmp_path / "text.gguf", TEXT), threads=2) as llama:
        theirs, _ = llama.encode(image)
    assert theirs.shape == ours.shape
    error = np.linalg.norm(theirs - ours) / np.linalg.norm(ours)
    assert error < DTYPE_BOUNDS[dtype], error
