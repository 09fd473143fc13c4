"""Per-layer features (moonvit.model.features.intermediates) of every tower, against per-image references.

- the ViT tower in the configurations VLA stacks load (ViT, DeiT, a SigLIP-like tower: no prefix tokens,
  tanh GELU, a MAP head; a DINOv2-like one: CLS + registers, LayerScale, a patch-only table, SwiGLU) on
  one pack of three grids, against a plain reference written here from the description: each image's
  token sequence built on its own (prefix rows, then patches plus the table's rows) and run through
  the tower's weights with a softmax attention over the whole image, nothing packed;
- transformers' ``ViTModel`` with ``output_hidden_states`` (image by image, ``interpolate_pos_encoding``);
- MoonViT against itself image by image (a pack of one image each), its final norm by hand;
- the argument errors.

Float64 throughout: the tolerance is ``ACROSS_SHAPES[float64]`` (1e-10), other kernels' rounding on
other shapes; the same rows read twice from one forward are compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import ACROSS_SHAPES, normal_images, patch_pack, randomise_, tiny_model
from transformers import (
    Dinov2WithRegistersConfig,
    Dinov2WithRegistersModel,
    SiglipVisionConfig,
    SiglipVisionModel,
    ViTConfig,
    ViTModel,
)

from moonvit.families.vit import ClassicViT
from moonvit.families.vit.model import ViTBlock
from moonvit.media.processor import patchify
from moonvit.model.encoder import MoonViTOutput
from moonvit.model.features import intermediate_indices, intermediates, read_intermediates

GRIDS = [(4, 4), (3, 5), (2, 1)]
CLOSE = ACROSS_SHAPES[torch.float64]
TOWERS = {
    "vit": dict(),
    "deit": dict(distillation_token=True),
    "siglip-like": dict(class_token=False, pool="map", hidden_act="gelu_tanh", layer_norm_eps=1e-6),
    "dinov2-like": dict(
        num_register_tokens=3, layer_scale=True, no_embed_class=True, mlp_type="swiglu", pos_emb_rule="timm"
    ),
}


def tower(name: str) -> ClassicViT:
    model = ClassicViT.from_preset("vit-tiny", **TOWERS[name]).to(torch.float64)
    return randomise_(model, seed=3).eval()


# ---- the plain reference ----------------------------------------------------------------------------


def reference_block(block: ViTBlock, x: torch.Tensor, heads: int) -> torch.Tensor:
    """(T, D) -> (T, D): one pre-LN block over one image's whole sequence, softmax(q k^T / sqrt(d)) v."""
    count, dim = x.shape
    q, k, v = F.linear(block.norm1(x), block.attn.qkv.weight, block.attn.qkv.bias).view(count, 3, heads, -1).unbind(1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(count, dim)
    branch = block.attn.proj(attended)
    x = x + (branch if block.ls1 is None else branch * block.ls1.gamma)
    hidden = block.mlp.fc1(block.norm2(x))
    if block.mlp.kind == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(hidden, approximate=block.mlp.approximate)
    branch = block.mlp.fc2(hidden)
    return x + (branch if block.ls2 is None else branch * block.ls2.gamma)


def reference_hidden(model: ClassicViT, picture: torch.Tensor) -> list[torch.Tensor]:
    """One (C, H, W) image: its (n_prefix + h * w, D) token rows after the embedding and after each block,
    prefix rows first (CLS, then the distillation token or the registers)."""
    config = model.config
    p = config.patch_size
    h, w = picture.shape[1] // p, picture.shape[2] // p
    patches = F.conv2d(picture[None], model.patch_embed.proj.weight, model.patch_embed.proj.bias, stride=p)
    patches = patches[0].flatten(1).T + model.position_table(h, w).reshape(h * w, -1)
    table_rows = model.pos_embed[0, : config.num_table_prefix_rows]
    tokens = [t[0, 0] for t in (model.cls_token, model.dist_token) if t is not None]
    embedded = [token + table_rows[i] if len(table_rows) else token for i, token in enumerate(tokens)]
    if model.reg_token is not None:  # after the CLS token, without a table row
        embedded = [embedded[0], *model.reg_token[0], *embedded[1:]]
    x = torch.cat([torch.stack(embedded), patches]) if embedded else patches
    states = [x]
    for block in model.blocks:
        x = reference_block(block, x, config.num_attention_heads)
        states.append(x)
    return states


# ---- the ViT tower ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TOWERS)
@pytest.mark.parametrize("norm", [False, True])
def test_vit_tower_intermediates_match_a_per_image_reference(name, norm):
    model = tower(name)
    count, patch = model.config.num_prefix_tokens, model.config.patch_size
    pictures = normal_images(GRIDS, patch)
    pixels, grids = patch_pack(pictures, patch)
    with torch.no_grad():
        found = intermediates(model, pixels, grids, indices=(0, 1, 2), norm=norm)
        expected = [reference_hidden(model, picture) for picture in pictures]
    assert found.indices == (0, 1, 2) and found.normed is norm and found.prefix_tokens is not None
    for k, index in enumerate(found.indices):
        rows = [states[index] for states in expected]
        if norm:
            rows = [model.norm(r) for r in rows]
        patches = torch.cat([r[count:] for r in rows])
        prefix = torch.stack([r[:count] for r in rows])
        assert found.patch_tokens[k].shape == patches.shape and found.prefix_tokens[k].shape == prefix.shape
        torch.testing.assert_close(found.patch_tokens[k], patches, **CLOSE)
        torch.testing.assert_close(found.prefix_tokens[k], prefix, **CLOSE)


@pytest.mark.parametrize("name", ["deit", "dinov2-like"])
def test_last_block_normed_is_the_forward_s_own_output_and_indices_agree(name):
    """``indices=-1, norm=True``: the forward's own rows, bit for bit; an int n is the last n blocks,
    negative indices the same blocks as positive ones; the default is the second-to-last block."""
    model = tower(name)
    pixels, grids = patch_pack(normal_images(GRIDS, 16), 16)
    with torch.no_grad():
        last = intermediates(model, pixels, grids, indices=(-1,), norm=True)
        out = last.output
        assert torch.equal(last.patch_tokens[0], out.last_hidden_state)
        assert last.prefix_tokens is not None and torch.equal(last.prefix_tokens[0], out.prefix_tokens)
        if model.config.pool == "token":
            assert torch.equal(last.prefix_tokens[0][:, 0], out.pooled)
        two = intermediates(model, pixels, grids, indices=2)
        listed = intermediates(model, pixels, grids, indices=(1, 2))
        negative = intermediates(model, pixels, grids, indices=(-2, -1))
        default = intermediates(model, pixels, grids)
    assert two.indices == listed.indices == negative.indices == (1, 2) and default.indices == (1,)
    for a, b, c in zip(two.patch_tokens, listed.patch_tokens, negative.patch_tokens):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(default.patch_tokens[0], two.patch_tokens[0])
    # hidden states asked through the forward hold the same rows
    with torch.no_grad():
        direct = model(pixels, grids, output_hidden_states=True)
    assert direct.hidden_prefix_tokens is not None and len(direct.hidden_prefix_tokens) == 3
    assert torch.equal(direct.hidden_states[1], two.patch_tokens[0])
    assert torch.equal(direct.hidden_prefix_tokens[2], two.prefix_tokens[1])


def test_a_tower_without_prefix_tokens_gives_empty_prefix_rows():
    model = tower("siglip-like")
    pixels, grids = patch_pack(normal_images(GRIDS, 16), 16)
    with torch.no_grad():
        found = intermediates(model, pixels, grids, indices=(-2, -1))
    assert found.prefix_tokens is not None
    assert [tuple(t.shape) for t in found.prefix_tokens] == [(3, 0, 64), (3, 0, 64)]


def check_hidden_states(
    folder: Path,
    reference: nn.Module,
    final_norm: nn.Module,
    patch: int,
    seed: int,
    indices: tuple[int, ...],
    prefix: int,
    close: dict[str, float],
    **call: Any,
) -> tuple[int, ...]:
    """The tower read from ``folder``: its intermediates at ``indices`` on one pack of :data:`GRIDS`, raw and
    ``norm=True``, against ``reference``'s ``hidden_states`` image by image (``call``: its other arguments).
    Each of the reference's states is (1, prefix + h * w, D): ``prefix`` prefix rows, then the patch rows;
    its ``final_norm`` of them is ``norm=True``'s. Returns the indices the intermediates resolved."""
    model = ClassicViT.from_pretrained(folder).eval()
    pictures = normal_images(GRIDS, patch, seed=seed)
    pixels, grids = patch_pack(pictures, patch)
    with torch.no_grad():
        raw = intermediates(model, pixels, grids, indices=indices)
        normed = intermediates(model, pixels, grids, indices=indices, norm=True)
        states = [reference(pixel_values=p[None], output_hidden_states=True, **call).hidden_states for p in pictures]
        for k, index in enumerate(raw.indices):
            rows = [s[index][0] for s in states]
            for found, transform in ((raw, lambda x: x), (normed, final_norm)):
                expected = [transform(r) for r in rows]
                assert found.prefix_tokens is not None
                assert found.prefix_tokens[k].shape == (len(pictures), prefix, rows[0].shape[-1])
                torch.testing.assert_close(found.patch_tokens[k], torch.cat([r[prefix:] for r in expected]), **close)
                torch.testing.assert_close(found.prefix_tokens[k], torch.stack([r[:prefix] for r in expected]), **close)
    return raw.indices


def test_vit_intermediates_match_transformers_hidden_states(tmp_path):
    """transformers' ViTModel, image by image at grids other than its native 4x4 (its bicubic table
    resampling, ``interpolate_pos_encoding``): hidden_states[i] (1, 1 + h * w, D) are the CLS row and the
    patch rows of block i; its layernorm of them is ``norm=True``'s."""
    config = ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=64,
        patch_size=16, layer_norm_eps=1e-6,
    )  # fmt: skip
    reference = ViTModel(config, add_pooling_layer=False).to(torch.float64)
    reference.set_attn_implementation("sdpa")
    randomise_(reference, seed=4).eval()
    reference.save_pretrained(tmp_path)
    check_hidden_states(
        tmp_path, reference, reference.layernorm, 16, 5, (0, 1, 2), 1, CLOSE, interpolate_pos_encoding=True
    )


def test_dinov2_intermediates_match_transformers_hidden_states(tmp_path):
    """A transformers ``Dinov2WithRegistersModel`` folder read by the dinov2 family: hidden_states[i]
    (1, 1 + R + h * w, D) are block i's CLS row, its R registers and its patch rows; its layernorm of
    them is ``norm=True``'s. Within 1e-5: transformers resamples its table in float32 (grids other than
    its native 4 x 4), the tower in float64."""
    config = Dinov2WithRegistersConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, mlp_ratio=2, image_size=32, patch_size=8,
        num_register_tokens=2,
    )  # fmt: skip
    reference = randomise_(Dinov2WithRegistersModel(config).double(), seed=6)
    reference.set_attn_implementation("sdpa")
    reference.eval().save_pretrained(tmp_path)
    close = dict(rtol=0.0, atol=1e-5)
    indices = check_hidden_states(tmp_path, reference, reference.layernorm, 8, 7, (0, 1, -2, -1), 3, close)
    assert indices == (0, 1, 2, 3)


def test_siglip_intermediates_match_transformers_hidden_states(tmp_path):
    """A transformers ``SiglipVisionModel`` folder read by the siglip family (no prefix tokens):
    hidden_states[i] (1, h * w, D), ``interpolate_pos_encoding`` for grids other than its native 4 x 4,
    are block i's patch rows; its ``post_layernorm`` of them is ``norm=True``'s; the prefix rows are empty."""
    config = SiglipVisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    reference = randomise_(SiglipVisionModel(config).double(), seed=8)
    reference.set_attn_implementation("sdpa")
    reference.eval().save_pretrained(tmp_path)
    check_hidden_states(
        tmp_path, reference, reference.post_layernorm, 8, 9, (0, 1, 2), 0, CLOSE, interpolate_pos_encoding=True
    )


# ---- MoonViT --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [False, True])
def test_moonvit_intermediates_match_its_images_one_by_one(norm):
    """A pack of three images against each image alone; ``norm=True`` is the final LayerNorm by hand."""
    model = tiny_model(dtype=torch.float64)
    grids = [(4, 6), (2, 2), (6, 4)]
    generator = torch.Generator().manual_seed(2)
    pictures = [torch.randn(3, 14 * h, 14 * w, generator=generator, dtype=torch.float64) for h, w in grids]
    pixels, grid = patch_pack(pictures, 14)
    ln = model.final_norm
    with torch.no_grad():
        found = intermediates(model, pixels, grid, indices=(0, -2, -1), norm=norm)
        alone = [model(patchify(p, 14), torch.tensor([[h, w]]), hidden_state_indices=(0, 1, 2)) for p, (h, w) in
                 zip(pictures, grids)]  # fmt: skip
    assert found.prefix_tokens is None and found.indices == (0, 1, 2)
    for k in range(3):
        expected = torch.cat([out.hidden_states[k] for out in alone])
        if norm:
            expected = F.layer_norm(expected, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        torch.testing.assert_close(found.patch_tokens[k], expected, **CLOSE)
    if norm:
        assert torch.equal(found.patch_tokens[-1], found.output.last_hidden_state)


# ---- errors ----------------------------------------------------------------------------------------------


def test_index_errors_are_named():
    model = tower("vit")
    pixels, grids = patch_pack(normal_images(GRIDS, 16), 16)
    with pytest.raises(ValueError, match=r"intermediates index: 3 is out of range for 3 hidden states"):
        intermediates(model, pixels, grids, indices=(3,))
    with pytest.raises(ValueError, match=r"intermediates index: -4 is out of range .* -3 \.\. 2"):
        intermediates(model, pixels, grids, indices=(0, -4))
    with pytest.raises(ValueError, match="asks for the last 3 blocks of a tower of 2"):
        intermediates(model, pixels, grids, indices=3)
    with pytest.raises(ValueError, match="no indices asked"):
        intermediates(model, pixels, grids, indices=())
    with pytest.raises(TypeError, match=r"intermediates index: 1\.5 is not an int"):
        intermediate_indices(2, (1.5,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is neither an int n"):
        intermediate_indices(2, True)


def test_read_intermediates_refuses_an_output_without_those_hidden_states():
    model = tower("vit")
    pixels, grids = patch_pack(normal_images(GRIDS, 16), 16)
    with torch.no_grad():
        plain = model(pixels, grids)
        two = model(pixels, grids, hidden_state_indices=(1, 2))
    with pytest.raises(ValueError, match=r"holds none hidden states for 1 indices \(1,\)"):
        read_intermediates(model, plain, (1,))
    with pytest.raises(ValueError, match="holds 2 hidden states for 1 indices"):
        read_intermediates(model, two, (1,))

    class NoNorm:  # an encoder without final_norm: its rows come back, only norm=True is refused
        config = model.config

        def __call__(self, *args, **kwargs) -> MoonViTOutput:
            return model(*args, **kwargs)

    assert len(intermediates(NoNorm(), pixels, grids).patch_tokens) == 1  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="NoNorm has no final_norm module"):
        intermediates(NoNorm(), pixels, grids, norm=True)  # type: ignore[arg-type]
