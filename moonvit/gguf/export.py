"""A MoonViT tower and its projector as a llama.cpp multimodal projector file ("mmproj" GGUF).

llama.cpp's ``mtmd`` library runs Kimi-VL's MoonViT (projector type ``kimivl``) and Kimi-K2.5's
(``kimik25``) from such a file, images only. This writes one from any tower this package holds
(a release, a fine-tune, one trained here), tensor for tensor as llama.cpp's own converter
(``convert_hf_to_gguf.py --mmproj``) writes it from a release folder: the same names, shapes, key
values and dtypes.

The two projector types differ in more than a name:

- ``kimik25`` (the default, also for a Kimi-VL tower): ``wqkv`` stays fused, its q and k rows
  permuted per head from the release's interleaved RoPE pairs to the split halves llama.cpp's
  2D RoPE rotates; the position table kept (H, W, D) and resampled bicubically. llama.cpp's
  graph then computes this package's tokens to float error. It marks images with K2.5's
  ``<|media_begin|>`` / ``<|media_end|>``.
- ``kimivl`` (Kimi-VL towers, as llama.cpp's converter writes them): ``wqkv`` split into q / k /
  v *without* the permutation, the table flattened to (H * W, D). llama.cpp's ``kimivl`` graph
  rotates split halves and resamples the table its own way, so it does not reproduce Kimi-VL's
  numbers; the file is what its converter writes, for compatibility. It marks images with
  Kimi-VL's ``<|media_start|>`` / ``<|media_end|>``.

Dtypes follow the converter: 1-D tensors, norms and the position table in F32; the patch
embedding in F16 for an F16 file, else F32; every other matrix in the file's dtype. Block
quantisation (Q8_0, Q4_K) is not offered: K2.5's 4304-wide MLP does not split into blocks of 32.
Kimi K3's tower (``kimik3``) is refused: it exists only in a fork of llama.cpp. So is a LayerNorm eps
the graph would not use: ``kimik25`` runs the tower's norms and the projector's pre-norm with the
file's one eps, ``kimivl`` the pre-norm with a fixed 1e-5.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..files import atomic_path
from ..media.processor import MoonViTImageProcessor
from ..model.encoder import MoonViT

__all__ = [
    "GGUF_DTYPES",
    "PROJECTOR_TYPES",
    "GgufSummary",
    "GgufUnavailableError",
    "export_gguf",
    "split_half_rope_rows",
    "tensor_dtype",
]

GGUF_DTYPES = ("f32", "f16", "bf16")
PROJECTOR_TYPES = ("kimik25", "kimivl")
MIN_PATCHES = 8
"""The converter's smallest image, in patches (``clip.vision.image_min_pixels`` = 8 * 14 * 14)."""
KIMIVL_PROJECTOR_EPS = 1e-5
"""The projector pre-norm's eps in llama.cpp's ``kimivl`` graph (fixed there, not read from the file)."""
_FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32}  # gguf.LlamaFileType: ALL_F32, MOSTLY_F16, MOSTLY_BF16


class GgufUnavailableError(RuntimeError):
    """The ``gguf`` package is missing (``pip install "moonvit[gguf]"``)."""


@dataclass(frozen=True)
class GgufSummary:
    """What was written: the file, its projector type and dtype, its tensors and its size."""

    path: Path
    projector_type: str
    dtype: str
    tensors: int
    bytes: int


def split_half_rope_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows (weight or bias) from the release's interleaved 2D RoPE layout to llama.cpp's.

    Per head, the release keeps ``head_dim / 4`` groups of (column pair, row pair); llama.cpp
    rotates the first half of a head by the column and the second half by the row. Each head's
    (head_dim / 4, 2, 2) layout becomes (2, head_dim / 4, 2).
    """
    out = rows.shape[0]
    grouped = rows.reshape(heads, out // heads // 4, 2, 2, *rows.shape[1:])
    return grouped.transpose(1, 2).reshape(rows.shape)


def _gguf() -> Any:
    if importlib.util.find_spec("gguf") is None:
        raise GgufUnavailableError('writing a GGUF file needs the gguf package: pip install "moonvit[gguf]"')
    import gguf

    return gguf


def _check(encoder: MoonViT, projector: Any, projector_type: str, dtype: str) -> None:
    c = encoder.config
    if dtype not in GGUF_DTYPES:
        raise ValueError(
            f"GGUF dtype must be one of {GGUF_DTYPES}, got {dtype!r} (block quantisation does not fit K2.5's "
            "4304-wide MLP, which is not a multiple of 32)"
        )
    if projector_type not in PROJECTOR_TYPES:
        raise ValueError(f"projector_type must be one of {PROJECTOR_TYPES}, got {projector_type!r}")
    if c.norm_type != "layernorm" or c.attention_width != c.hidden_size or not (c.attn_bias and c.linear_bias):
        raise ValueError(
            "Kimi K3's tower (MoonViT-V2, llama.cpp projector type 'kimik3') is not in llama.cpp yet (only in a "
            "fork): no GGUF is written for it; export it to ONNX (python -m moonvit.onnx) instead"
        )
    if c.pos_emb_interpolation_mode != "bicubic" or not c.patch_embed_proj_bias:
        raise ValueError("llama.cpp's Kimi graphs resample the position table bicubically and add a patch bias")
    if projector_type == "kimivl" and c.init_pos_emb_time:
        raise ValueError(
            "a tower with a temporal table (Kimi-K2.5 / K2.6) is exported as 'kimik25'; 'kimivl' is Kimi-VL's type"
        )
    pc = getattr(projector, "config", None)
    if pc is None or pc.projector_type != "kimi":
        kind = None if pc is None else pc.projector_type
        raise ValueError(
            f"llama.cpp's Kimi graphs take Kimi-VL / K2.5's projector (LayerNorm, Linear, GELU, Linear); this one is "
            f"{kind!r}"
        )
    if pc.vision_hidden_size != c.hidden_size or tuple(pc.merge_kernel_size) != tuple(c.merge_kernel_size):
        raise ValueError(
            f"the projector takes {pc.vision_hidden_size}-wide {pc.merge_kernel_size} groups, the tower gives "
            f"{c.hidden_size}-wide {c.merge_kernel_size} ones"
        )
    if c.patch_size != 14 or tuple(c.merge_kernel_size) != (2, 2) or c.rope_theta != 10000.0:
        raise ValueError("llama.cpp's Kimi graphs assume 14 px patches, a 2x2 merger and RoPE theta 10000")
    _check_eps(c.layer_norm_eps, pc.layer_norm_eps, projector_type)


def _check_eps(tower_eps: float | None, projector_eps: float, projector_type: str) -> None:
    """The file has one eps (``clip.vision.attention.layer_norm_epsilon``): ``kimik25``'s graph uses
    it for the tower's norms and the projector's pre-norm alike, ``kimivl``'s for the tower's only,
    with the projector's fixed at 1e-5. A model whose norms llama.cpp would run with another eps is
    refused rather than exported with a silently different one."""
    assert tower_eps is not None  # a LayerNorm tower (checked before)
    if projector_type == "kimik25" and float(tower_eps) != float(projector_eps):
        raise ValueError(
            f"the tower's LayerNorm eps ({tower_eps:g}) differs from its projector's ({projector_eps:g}), but "
            "llama.cpp's kimik25 graph takes one eps for both: no GGUF file computes this model"
        )
    if projector_type == "kimivl" and float(projector_eps) != KIMIVL_PROJECTOR_EPS:
        raise ValueError(
            f"the projector's LayerNorm eps ({projector_eps:g}) is not the {KIMIVL_PROJECTOR_EPS:g} llama.cpp's "
            "kimivl graph fixes for it; export as 'kimik25' if the tower's eps is the same"
        )


def _tensors(encoder: MoonViT, projector: Any, projector_type: str) -> dict[str, torch.Tensor]:
    """The file's tensors by GGUF name, float32, in the layout ``projector_type`` expects."""
    c = encoder.config
    state = {name: t.detach().to("cpu", torch.float32) for name, t in encoder.state_dict().items()}
    table = state["patch_embed.pos_emb.weight"]
    out: dict[str, torch.Tensor] = {
        "v.patch_embd.weight": state["patch_embed.proj.weight"],
        "v.patch_embd.bias": state["patch_embed.proj.bias"],
        "v.position_embd.weight": table if projector_type == "kimik25" else table.flatten(0, 1),
        "v.post_ln.weight": state["encoder.final_layernorm.weight"],
        "v.post_ln.bias": state["encoder.final_layernorm.bias"],
    }
    renames = {"norm0": "ln1", "norm1": "ln2", "wo": "attn_out", "mlp.fc0": "ffn_up", "mlp.fc1": "ffn_down"}
    for i in range(c.num_hidden_layers):
        block = f"encoder.blocks.{i}."
        for ours, theirs in renames.items():
            for kind in ("weight", "bias"):
                out[f"v.blk.{i}.{theirs}.{kind}"] = state[f"{block}{ours}.{kind}"]
        for kind in ("weight", "bias"):
            q, k, v = state[f"{block}wqkv.{kind}"].chunk(3)
            if projector_type == "kimik25":
                heads = c.num_attention_heads
                fused = torch.cat([split_half_rope_rows(q, heads), split_half_rope_rows(k, heads), v])
                out[f"v.blk.{i}.attn_qkv.{kind}"] = fused
            else:  # as llama.cpp's converter writes Kimi-VL: split, not permuted
                for name, part in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
                    out[f"v.blk.{i}.{name}.{kind}"] = part
    p = {name: t.detach().to("cpu", torch.float32) for name, t in projector.state_dict().items()}
    out.update(
        {
            "mm.input_norm.weight": p["pre_norm.weight"],
            "mm.input_norm.bias": p["pre_norm.bias"],
            "mm.1.weight": p["linear_1.weight"],
            "mm.1.bias": p["linear_1.bias"],
            "mm.2.weight": p["linear_2.weight"],
            "mm.2.bias": p["linear_2.bias"],
        }
    )
    return out


def tensor_dtype(name: str, tensor: torch.Tensor, dtype: str) -> str:
    """The GGML type the converter gives a tensor in a file of ``dtype``: F32 for 1-D tensors, norms,
    biases and the position table; the patch embedding F16 in an F16 file, else F32; the rest ``dtype``."""
    if tensor.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return "f32"
    if name == "v.position_embd.weight":
        return "f32"
    if name == "v.patch_embd.weight":
        return "f16" if dtype == "f16" else "f32"
    return dtype


def export_gguf(
    encoder: MoonViT,
    projector: Any,
    processor: MoonViTImageProcessor,
    path: str | os.PathLike,
    *,
    dtype: str = "f32",
    projector_type: str = "kimik25",
    text_hidden_size: int | None = None,
    name: str = "moonvit",
) -> GgufSummary:
    """Write ``encoder`` and ``projector`` as an mmproj GGUF file that llama.cpp's ``mtmd`` loads.

    Args:
        encoder: a Kimi-VL or Kimi-K2.5 / K2.6 tower (any size; Kimi K3's is refused).
        projector: its Kimi projector (:class:`moonvit_projector.MoonViTProjector`, ``"kimi"`` type).
        processor: its settings: mean / std and, for ``kimik25``, the patch budget (the file's
            ``image_max_pixels``).
        dtype: ``"f32"``, ``"f16"`` or ``"bf16"`` for the matrices (see the module docstring).
        projector_type: ``"kimik25"`` (default: faithful numbers in llama.cpp) or ``"kimivl"``
            (Kimi-VL towers: what llama.cpp's converter writes, with its graph's deviations).
        text_hidden_size: the LLM width (``clip.vision.projection_dim``); default the projector's.
        name: ``general.name``.

    Raises:
        ValueError: a K3 tower, another projector, or a setting llama.cpp's Kimi graphs do not take.
        GgufUnavailableError: the ``gguf`` package is missing.
    """
    _check(encoder, projector, projector_type, dtype)
    gguf = _gguf()
    c, pc = encoder.config, projector.config
    target = Path(path)
    tensors = _tensors(encoder, projector, projector_type)
    qtypes = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "bf16": gguf.GGMLQuantizationType.BF16}  # fmt: skip
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as temporary:
        writer = gguf.GGUFWriter(temporary, arch="clip")
        writer.add_string("general.type", "mmproj")
        writer.add_string("general.name", name)
        writer.add_uint32("general.file_type", _FILE_TYPES[dtype])
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_uint32("clip.vision.projection_dim", int(text_hidden_size or pc.text_hidden_size))
        writer.add_uint32("clip.vision.image_size", c.init_pos_emb_height * c.patch_size)
        writer.add_uint32("clip.vision.patch_size", c.patch_size)
        writer.add_uint32("clip.vision.embedding_length", c.hidden_size)
        writer.add_uint32("clip.vision.feed_forward_length", c.intermediate_size)
        writer.add_uint32("clip.vision.block_count", c.num_hidden_layers)
        writer.add_uint32("clip.vision.attention.head_count", c.num_attention_heads)
        writer.add_array("clip.vision.image_mean", [float(x) for x in processor.image_mean])
        writer.add_array("clip.vision.image_std", [float(x) for x in processor.image_std])
        writer.add_string("clip.projector_type", projector_type)
        if projector_type == "kimik25":
            writer.add_uint32("vision.pos_emb_height", c.init_pos_emb_height)
            writer.add_uint32("vision.pos_emb_width", c.init_pos_emb_width)
            writer.add_uint32("vision.pos_emb_time", c.init_pos_emb_time)
        writer.add_bool("clip.use_gelu", True)
        # The tower's eps; for kimik25 also the projector's (_check_eps refuses them differing).
        assert c.layer_norm_eps is not None  # a LayerNorm tower (checked above)
        writer.add_float32("clip.vision.attention.layer_norm_epsilon", float(c.layer_norm_eps))
        writer.add_uint32("clip.vision.projector.scale_factor", c.merge_kernel_size[0])
        if projector_type == "kimik25":
            pixels = c.patch_size**2
            writer.add_uint32("clip.vision.image_min_pixels", MIN_PATCHES * pixels)
            writer.add_uint32("clip.vision.image_max_pixels", processor.in_token_limit * pixels)
        writer.add_uint32("general.quantization_version", 2)
        for tensor_name, tensor in tensors.items():
            qtype = qtypes[tensor_dtype(tensor_name, tensor, dtype)]
            # As the converter writes it: quantize() gives float32 / float16 arrays or, for BF16 (which
            # numpy lacks), the bytes as uint8 with the last dimension doubled; the writer derives the
            # element shape from that byte shape. A raw_shape would be taken for a byte shape and halved.
            writer.add_tensor(tensor_name, gguf.quants.quantize(tensor.contiguous().numpy(), qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return GgufSummary(target, projector_type, dtype, len(tensors), target.stat().st_size)
