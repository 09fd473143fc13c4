"""Interoperability with transformers' Kimi-K2.5 vision tower (``Kimi_K25VisionModel``).

transformers ships the same MoonViT tower with separate q/k/v projections in a
half-split RoPE layout; :func:`to_transformers` builds that model from ours, with
transformers' own ``PermuteForRope`` doing the RoPE weight permutation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

    from ..model.encoder import MoonViT

# Block submodules: ours (Kimi-VL's names) -> transformers'.
BLOCK_RENAMES = {"norm0": "norm1", "norm1": "norm2", "wo": "attn.proj", "mlp.fc0": "mlp.fc1", "mlp.fc1": "mlp.fc2"}


def to_transformers(model: MoonViT, attn_implementation: str = "sdpa") -> Kimi_K25VisionModel:
    """An equivalent ``Kimi_K25VisionModel`` in the model's dtype, in eval mode.

    Needs transformers with the ``kimi_k25`` model (5.x).
    """
    from transformers.core_model_loading import PermuteForRope
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

    c = model.config
    config = Kimi_K25VisionConfig(
        patch_size=c.patch_size,
        pos_emb_height=c.init_pos_emb_height,
        pos_emb_width=c.init_pos_emb_width,
        pos_emb_time=c.init_pos_emb_time or 4,  # an image-only tower never reads it
        num_attention_heads=c.num_attention_heads,
        num_hidden_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        merge_kernel_size=list(c.merge_kernel_size),
        rope_parameters={"rope_type": "axial", "rope_theta": c.rope_theta},
    )
    config._attn_implementation = attn_implementation
    permute = PermuteForRope()._permute_for_rope
    state = model.state_dict()
    out = {
        "patch_embed.proj.weight": state["patch_embed.proj.weight"],
        "patch_embed.proj.bias": state["patch_embed.proj.bias"],
        "patch_embed.pos_emb.position_embeddings": state["patch_embed.pos_emb.weight"],
        "final_layernorm.weight": state["encoder.final_layernorm.weight"],
        "final_layernorm.bias": state["encoder.final_layernorm.bias"],
    }
    for i in range(c.num_hidden_layers):
        src, dst = f"encoder.blocks.{i}.", f"layers.{i}."
        for ours, theirs in BLOCK_RENAMES.items():
            for kind in ("weight", "bias"):
                out[f"{dst}{theirs}.{kind}"] = state[f"{src}{ours}.{kind}"]
        for kind in ("weight", "bias"):
            q, k, v = state[f"{src}wqkv.{kind}"].chunk(3)
            out[f"{dst}attn.q_proj.{kind}"] = permute(q, config)
            out[f"{dst}attn.k_proj.{kind}"] = permute(k, config)
            out[f"{dst}attn.v_proj.{kind}"] = v
    peer = Kimi_K25VisionModel(config)
    missing, unexpected = peer.load_state_dict(out, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"transformers' Kimi_K25VisionModel changed: missing {missing}, unexpected {unexpected}")
    peer.to(model.dtype)  # type: ignore[arg-type]  # transformers types its wrapped .to() oddly
    return peer.eval()
