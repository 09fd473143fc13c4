import dataclasses
import itertools
import logging
import sys
import types

import pytest
import torch
from helpers import FLEX, random_pack, tiny_model
from reference import reference_forward

import moonvit.model.attention as attention
import moonvit.model.blocks as blocks
import moonvit.model.rope as rope
from moonvit import MoonViT, preset_config

MIXED = [(2, 2), (6, 10), (4, 4), (66, 4), (2, 68), (4, 4)]
BACKENDS = ["eager", "sdpa"]


def run(model, pixels, grids, impl):
    model.set_attn_implementation(impl)
    return model(pixels, grids)


@pytest.mark.parametrize("impl", BACKENDS)
def test_matches_independent_reference_float64(impl):
    model = tiny_model(dtype=torch.float64)
    pixels, grids = random_pack(MIXED, dtype=torch.float64)
    out = run(model, pixels, grids, impl)
    hidden, merged = reference_forward(model.state_dict(), model.config, pixels, grids)
    # The reference rotates in float32 (complex64), as upstream does: 1e-6 is its precision.
    torch.testing.assert_close(out.last_hidden_state, hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.merged, merged, rtol=1e-5, atol=1e-5)
    assert out.last_hidden_state.shape == (sum(h * w for h, w in MIXED), 64)
    assert out.merged.shape == (sum(h * w for h, w in MIXED) // 4, 4, 64)


def test_matches_independent_reference_float32():
    model = tiny_model()
    pixels, grids = random_pack(MIXED)
    out = run(model, pixels, grids, "sdpa")
    hidden, merged = reference_forward(model.state_dict(), model.config, pixels, grids)
    torch.testing.assert_close(out.last_hidden_state, hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.merged, merged, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", BACKENDS)
def test_image_alone_equals_image_in_pack(impl):
    model = tiny_model()
    pixels, grids = random_pack(MIXED)
    packed = run(model, pixels, grids, impl)
    start, merged_start = 0, 0
    for i, (h, w) in enumerate(MIXED):
        alone = run(model, pixels[start : start + h * w], grids[i : i + 1], impl)
        torch.testing.assert_close(
            packed.last_hidden_state[start : start + h * w], alone.last_hidden_state, rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            packed.merged[merged_start : merged_start + h * w // 4], alone.merged, rtol=1e-5, atol=1e-5
        )
        start += h * w
        merged_start += h * w // 4


@pytest.mark.parametrize("impl", [*BACKENDS, FLEX])
def test_images_never_attend_to_each_other(impl):
    model = tiny_model()
    pixels, grids = random_pack([(4, 4), (4, 4), (2, 6)])
    with torch.no_grad():  # flex has no CPU backward
        before = run(model, pixels, grids, impl).last_hidden_state
        pixels[16:32] = torch.randn(16, 3, 14, 14) * 10  # change only the second image
        after = run(model, pixels, grids, impl).last_hidden_state
    assert torch.equal(before[:16], after[:16]) and torch.equal(before[32:], after[32:])
    assert not torch.allclose(before[16:32], after[16:32])


def test_backends_agree_float32_and_bfloat16():
    pixels, grids = random_pack(MIXED)
    model = tiny_model()
    eager, sdpa = (run(model, pixels, grids, impl).last_hidden_state for impl in BACKENDS)
    torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-5)
    model = tiny_model(dtype=torch.bfloat16)
    eager, sdpa = (run(model, pixels, grids, impl).last_hidden_state.float() for impl in BACKENDS)
    torch.testing.assert_close(sdpa, eager, rtol=0.05, atol=0.05)


def test_backend_gradients_agree():
    pixels, grids = random_pack([(2, 2), (4, 6), (4, 6)])
    grads = {}
    for impl in BACKENDS:
        model = tiny_model()
        model.set_attn_implementation(impl)
        x = pixels.clone().requires_grad_(True)
        out = model(x, grids)
        (out.last_hidden_state.square().mean() + out.merged[:, 0].sum()).backward()
        grads[impl] = [x.grad] + [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads[impl])
    for eager, sdpa in zip(grads["eager"], grads["sdpa"]):
        torch.testing.assert_close(sdpa, eager, rtol=1e-4, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(monkeypatch):
    """Checkpointed, each block's forward runs again in backward (none does without), and the
    gradients are those of the plain backward."""
    pixels, grids = random_pack([(4, 4), (2, 6)])
    calls = {"forward": 0, "backward": 0}
    phase = ["forward"]
    original = blocks.Block.forward

    def counted(self, *args, **kwargs):
        calls[phase[0]] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(blocks.Block, "forward", counted)
    results, counts = [], []
    for checkpointing in (False, True):
        model = tiny_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        calls.update(forward=0, backward=0)
        phase[0] = "forward"
        loss = model(pixels, grids).last_hidden_state.sum()
        phase[0] = "backward"
        loss.backward()
        counts.append(dict(calls))
        results.append([p.grad for p in model.parameters()])
    depth = tiny_model().config.num_hidden_layers
    assert counts == [{"forward": depth, "backward": 0}, {"forward": depth, "backward": depth}]
    for plain, checkpointed in zip(*results):
        torch.testing.assert_close(checkpointed, plain)


def test_precomputed_grid_gives_the_same_output():
    model = tiny_model()
    pixels, grids = random_pack(MIXED)
    grid = model.prepare_grid(grids)
    assert torch.equal(model(pixels, grid=grid).last_hidden_state, model(pixels, grids).last_hidden_state)


def test_inference_caches_serve_a_later_training_step():
    model = tiny_model()
    model.set_position_cache()
    pixels, grids = random_pack(MIXED)
    with torch.inference_mode():
        cached = model(pixels, grids).last_hidden_state
    assert model.patch_embed.pos_emb._cache  # filled by the inference call
    for p in model.parameters():
        p.requires_grad_(False)  # a frozen encoder inside a trained VLM
    pixels.requires_grad_(True)
    out = model(pixels, grids).last_hidden_state
    torch.testing.assert_close(out, cached, rtol=0, atol=0)
    out.square().sum().backward()
    assert pixels.grad is not None and pixels.grad.abs().sum() > 0

    for p in model.parameters():
        p.requires_grad_(True)  # unfrozen: the table trains, so its cache is bypassed
    model(pixels, grids).last_hidden_state.sum().backward()
    assert model.patch_embed.pos_emb.weight.grad.abs().sum() > 0


def test_row_chunked_mlp_and_rope_match_one_pass(monkeypatch):
    model = tiny_model(dtype=torch.float64)  # float64: the chunks' matmul blocking cannot show
    pixels, grids = random_pack(MIXED, dtype=torch.float64)
    expected = model(pixels, grids).last_hidden_state
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(blocks, "MLP_CHUNK_BYTES", 7 * model.config.intermediate_size * 8)  # 7 rows
    monkeypatch.setattr(rope, "CHUNK_BYTES", 5 * model.config.hidden_size * 8)  # 5 rows
    out = model(pixels, grids).last_hidden_state
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    for p, grad in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, grad, rtol=1e-10, atol=1e-12)


def test_projections_run_through_their_modules():
    # LoRA wrappers, quantisation and pruning replace or hook these modules.
    model = tiny_model()
    calls = []
    for block in model.encoder.blocks:
        for module in (block.wqkv, block.wo, block.mlp.fc0, block.mlp.fc1):
            module.register_forward_hook(lambda *args: calls.append(1))
    model(*random_pack([(2, 2)]))
    assert len(calls) == 4 * model.config.num_hidden_layers


def test_hidden_states_per_block():
    model = tiny_model()
    pixels, grids = random_pack([(2, 2)])
    out = model(pixels, grids, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert all(h.shape == (4, 64) for h in out.hidden_states)
    assert model(pixels, grids).hidden_states is None


def test_bfloat16_stays_close_to_float64():
    pixels, grids = random_pack(MIXED)
    exact = tiny_model(dtype=torch.float64)(pixels.double(), grids).last_hidden_state
    out = tiny_model(dtype=torch.bfloat16)(pixels, grids)
    assert out.last_hidden_state.dtype == torch.bfloat16 and out.merged.dtype == torch.bfloat16
    error = (out.last_hidden_state.double() - exact).norm() / exact.norm()
    assert error < 0.02


def test_one_by_one_merged_token_and_float_pixels_cast():
    model = tiny_model(dtype=torch.bfloat16)
    pixels, grids = random_pack([(2, 2)])  # float32 pixels into a bf16 model
    out = model(pixels, grids)
    assert out.merged.shape == (1, 4, 64)


def test_presets_and_real_dimensions():
    c = preset_config("so400m")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (1152, 27, 16, 4304)
    assert (c.patch_size, c.init_pos_emb_height, c.init_pos_emb_width, c.merge_kernel_size) == (14, 64, 64, (2, 2))
    assert c.head_dim == 72 and c.layer_norm_eps == 1e-5 and c.rope_theta == 10000.0
    with torch.device("meta"):
        model = MoonViT(c)
    assert model.patch_embed.pos_emb.weight.shape == (64, 64, 1152)
    assert model.encoder.blocks[0].wqkv.weight.shape == (3456, 1152)
    with pytest.raises(ValueError, match="unknown preset"):
        MoonViT.from_preset("huge")


@pytest.mark.parametrize(
    "pixels, grids, error, message",
    [
        (torch.rand(4, 3, 14, 14).to(torch.uint8), [[2, 2]], TypeError, "floating"),
        (torch.rand(4, 3, 16, 16), [[2, 2]], ValueError, r"shape \(L, 3, 14, 14\)"),
        (torch.rand(4, 588), [[2, 2]], ValueError, r"shape \(L, 3, 14, 14\)"),
        (torch.rand(8, 3, 14, 14), [[2, 2]], ValueError, r"8 patches but the grids add up to sum\(h \* w\) = 4"),
        (torch.rand(4, 3, 14, 14), [[2.0, 2.0]], TypeError, "integer"),
        (torch.rand(0, 3, 14, 14), torch.zeros(0, 2, dtype=torch.int64), ValueError, "empty pack"),
        (torch.rand(12, 3, 14, 14), [[3, 4]], ValueError, "not divisible"),
        ([[0.0]], [[2, 2]], TypeError, "must be a tensor"),
    ],
)
def test_bad_input_is_named(pixels, grids, error, message):
    with pytest.raises(error, match=message):
        tiny_model()(pixels, grids)


def test_forward_needs_a_grid():
    with pytest.raises(TypeError, match="forward needs grid_thws"):
        tiny_model()(torch.rand(4, 3, 14, 14))


# ---- attention dispatch ------------------------------------------------------------


def test_auto_falls_back_to_sdpa_with_one_log_line(caplog, monkeypatch):
    monkeypatch.setattr(attention, "_logged_fallbacks", set())
    model = tiny_model()
    pixels, grids = random_pack([(2, 2)])
    with caplog.at_level(logging.INFO, logger="moonvit"):
        model(pixels, grids)
        model(pixels, grids)
    lines = [r.getMessage() for r in caplog.records if r.name == "moonvit"]
    assert len(lines) == 1 and "using sdpa" in lines[0]


def test_explicit_flash_where_it_cannot_run_is_a_clear_error(monkeypatch):
    if not attention.flash_attn_installed():
        with pytest.raises(RuntimeError, match="needs flash-attn"):
            MoonViT(preset_config("tiny", attn_implementation="flash_attention_2"))
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        attention.resolve_attn_implementation("flash_attention_2", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs bf16 or fp16"):
        attention.resolve_attn_implementation("flash_attention_2", torch.device("cuda"), torch.float32)
    assert attention.resolve_attn_implementation("auto", torch.device("cuda"), torch.bfloat16) == "flash_attention_2"
    assert attention.resolve_attn_implementation("auto", torch.device("cuda"), torch.float32) == "sdpa"


def test_flash_path_calls_varlen_kernel_with_int32_cu_seqlens(monkeypatch):
    """The flash path, run through a stand-in for flash_attn_varlen_func that checks
    its arguments the way flash-attn does and computes attention per sequence."""
    calls = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q[0] == 0 and cu_seqlens_q[-1] == q.shape[0]
        assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) and not causal
        calls.append(cu_seqlens_q.tolist())
        out = torch.empty_like(q)
        bounds = cu_seqlens_q.tolist()
        for s, e in itertools.pairwise(bounds):
            scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * softmax_scale
            out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s:e])
        return out

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen))
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    flash = attention._BACKENDS["flash_attention_2"]
    monkeypatch.setitem(
        attention._BACKENDS, "flash_attention_2", dataclasses.replace(flash, unavailable=lambda d, t: None)
    )
    model = tiny_model()
    pixels, grids = random_pack([(2, 2), (4, 6)])
    flash = run(model, pixels, grids, "flash_attention_2").last_hidden_state
    sdpa = run(model, pixels, grids, "sdpa").last_hidden_state
    assert calls == [[0, 4, 28]] * model.config.num_hidden_layers
    torch.testing.assert_close(flash, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiles_as_one_graph_with_a_precomputed_grid():
    model = tiny_model()
    pixels, grids = random_pack([(2, 2), (4, 6), (4, 6)])
    grid = model.prepare_grid(grids)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(
            compiled(pixels, grid=grid).last_hidden_state,
            model(pixels, grid=grid).last_hidden_state,
            rtol=1e-4,
            atol=1e-4,
        )


def test_sdpa_never_builds_a_pack_wide_mask(monkeypatch):
    """Memory linear in the patches: every SDPA call sees one image length and no mask."""
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((tuple(q.shape), args, kwargs))
        return real_sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    model = tiny_model()
    pixels, grids = random_pack([(16, 16)] * 32 + [(2, 4)])
    run(model, pixels, grids, "sdpa")
    layers = model.config.num_hidden_layers
    default = {"scale": None}  # head_dim ** -0.5
    expected = [((1, 4, 8, 16), (), default), ((32, 4, 256, 16), (), default)] * layers
    assert sorted(calls, key=str) == sorted(expected, key=str)
