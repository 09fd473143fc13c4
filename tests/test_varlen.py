"""The ``varlen`` backend's packing on CPU tensors: torch's ``varlen_attn`` replaced by a reference that
checks its arguments as the kernel needs them (int32 ``cu_seqlens`` on q's device, Python-int
lengths, no rows past the last item) and attends per item with SDPA; the real kernel runs in
``tests/test_cuda.py``."""

from __future__ import annotations

import dataclasses
import functools
import importlib.machinery
import itertools
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_across_shapes, random_pack, tiny_model

from moonvit.model import attention, varlen


def reference_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    """torch 2.13's ``varlen_attn`` signature; per-item SDPA (differentiable, so backward works too)."""
    assert cu_seq_q.dtype == torch.int32 and cu_seq_q.device == query.device and cu_seq_k is cu_seq_q
    assert type(max_q) is int and type(max_k) is int and max_q == max_k
    bounds = cu_seq_q.tolist()
    assert bounds[0] == 0 and bounds[-1] == query.shape[0], "rows past the last item: NaN gradients"
    assert max_q == max(b - a for a, b in itertools.pairwise(bounds))
    assert window_size == (-1, -1) and scale == query.shape[-1] ** -0.5 and return_aux is None
    CALLS.append((bounds, max_q))
    outputs = []
    for a, b in itertools.pairwise(bounds):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        outputs.append(F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1))
    return torch.cat(outputs)


def old_reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature: ``is_causal``, no ``scale`` (the kernel's default, head_dim ** -0.5)."""
    assert is_causal is False
    return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=query.shape[-1] ** -0.5)


CALLS: list[tuple[list[int], int]] = []


@pytest.fixture
def kernel(monkeypatch):
    """``kernel(fn)``: ``fn`` stands in for ``torch.nn.attention.varlen.varlen_attn``, and the backend
    may run on CPU; returns the calls' (cu_seqlens, max) as the kernel got them."""

    def use(fn=reference_varlen_attn) -> list[tuple[list[int], int]]:
        module = types.ModuleType("torch.nn.attention.varlen")
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        module.varlen_attn = fn  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setattr(varlen, "_found", {})
        return CALLS

    backend = attention._BACKENDS["varlen"]
    monkeypatch.setitem(attention._BACKENDS, "varlen", dataclasses.replace(backend, unavailable=lambda d, t: None))
    monkeypatch.setattr(attention, "_logged_fallbacks", set())
    CALLS.clear()
    return use


def run(model, pixels, grids, backend):
    model.set_attn_implementation(backend)
    model.zero_grad(set_to_none=True)
    x = pixels.clone().requires_grad_(True)
    out = model(x, grids).last_hidden_state
    out.square().mean().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()]


# images of three sizes (two equal ones apart), and clips with an image between them
PACKS = {
    "images": [(1, 2, 2), (1, 4, 6), (1, 6, 6), (1, 4, 6)],
    "clips": [(3, 4, 4), (1, 2, 6), (2, 6, 4)],
}


@pytest.mark.parametrize("pack", PACKS)
def test_one_call_per_block_with_the_packs_bounds_forward_and_backward_as_sdpa(kernel, pack):
    calls = kernel()
    model = tiny_model(seed=1, init_pos_emb_time=4).train()
    thw = torch.tensor(PACKS[pack])
    pixels, _ = random_pack([(t * h, w) for t, h, w in PACKS[pack]], seed=2)
    ours = run(model, pixels, thw, "varlen")
    grid = model.prepare_grid(thw)
    assert calls == [(grid.cu_seqlens.tolist(), grid.max_seqlen)] * model.config.num_hidden_layers
    theirs = run(model, pixels, thw, "sdpa")
    for a, b in zip([ours[0], ours[1], *ours[2]], [theirs[0], theirs[1], *theirs[2]], strict=True):
        assert_close_across_shapes(a, b)


def test_dropped_patches_the_pack_of_the_kept_rows(kernel):
    """Token dropping (training): cu_seqlens count the kept rows, and nothing else reaches the kernel."""
    calls = kernel()
    model = tiny_model(seed=1)
    keep = [torch.tensor([0, 2, 3]), torch.arange(0, 24, 2)]
    grid = model.prepare_grid(torch.tensor([[2, 2], [4, 6]]), keep=keep)
    q, k, v = (torch.randn(15, 4, 16) for _ in range(3))
    out = attention.bind_attention("varlen", grid)(q, k, v)
    assert calls == [([0, 3, 15], 12)]
    assert_close_across_shapes(out, attention.bind_attention("sdpa", grid)(q, k, v))


def test_the_old_signature_gets_is_causal_and_its_default_scale(kernel):
    kernel(old_reference_varlen_attn)
    model = tiny_model(seed=1)
    pixels, grids = random_pack([(2, 2), (4, 6)])
    with torch.no_grad():
        model.set_attn_implementation("varlen")
        ours = model(pixels, grids).last_hidden_state
        model.set_attn_implementation("sdpa")
        assert_close_across_shapes(ours, model(pixels, grids).last_hidden_state)


def test_rows_past_the_last_item_are_refused_before_the_kernel(kernel):
    """torch's varlen_attn gives NaN gradients to rows past cu_seqlens[-1]: refused, naming why."""
    calls = kernel()
    grid = tiny_model().prepare_grid(torch.tensor([[2, 2], [4, 6]]))
    q = torch.randn(28 + 3, 4, 16)
    with pytest.raises(ValueError, match=r"31 packed rows for a pack of 28 \(cu_seqlens\[-1\]\).*NaN gradients"):
        attention.varlen_attention(q, q, q, grid)
    with pytest.raises(ValueError, match="27 packed rows"):
        attention.varlen_attention(q[:27], q[:27], q[:27], grid)
    assert calls == []


def test_cu_seqlens_go_in_as_int32_on_qs_device_without_a_copy_where_they_are(kernel):
    grid = tiny_model().prepare_grid(torch.tensor([[2, 2], [4, 6]]))
    q = torch.randn(28, 4, 16)
    cu_seqlens, longest = varlen.varlen_arguments(q, grid)
    assert cu_seqlens is grid.cu_seqlens and type(longest) is int and longest == 24
    wide = dataclasses.replace(grid, cu_seqlens=grid.cu_seqlens.long())
    cu_seqlens, _ = varlen.varlen_arguments(q, wide)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 4, 28]


def test_views_of_the_qkv_buffer_go_in_as_they_are(kernel):
    """The block hands q, k, v as strided views of wqkv's output: no copies on the way in."""
    seen = []

    def spy(query, key, value, *args, **kwargs):
        seen.append((query.data_ptr(), key.data_ptr(), value.data_ptr()))
        return reference_varlen_attn(query, key, value, *args, **kwargs)

    kernel(functools.wraps(reference_varlen_attn)(spy))
    grid = tiny_model().prepare_grid(torch.tensor([[2, 2], [4, 6]]))
    qkv = torch.randn(28, 3, 4, 16)
    attention.varlen_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], grid)
    assert seen == [(qkv[:, 0].data_ptr(), qkv[:, 1].data_ptr(), qkv[:, 2].data_ptr())]


def test_a_head_dim_the_kernel_does_not_take_runs_sdpa_and_says_so_once(kernel, caplog):
    calls = kernel()
    grid = tiny_model().prepare_grid(torch.tensor([[2, 2], [4, 6]]))
    q, k, v = (torch.randn(28, 2, 12) for _ in range(3))
    with caplog.at_level(logging.INFO, logger="moonvit"):
        outputs = [attention.varlen_attention(q, k, v, grid) for _ in range(2)]
    assert calls == []
    assert all(torch.equal(out, attention.sdpa_attention(q, k, v, grid)) for out in outputs)  # the same call
    lines = [r.getMessage() for r in caplog.records if r.name == "moonvit"]
    assert len(lines) == 1 and "multiple of 8 up to 256, the model's is 12; using sdpa" in lines[0]
    assert varlen.varlen_head_dim_unsupported(264) is not None
    assert all(varlen.varlen_head_dim_unsupported(d) is None for d in (64, 72, 96, 128, 256))


@pytest.mark.slow
def test_compiles_as_one_graph(kernel):
    """The lookups around the kernel (its signature, the keywords, the row check) trace without a break."""
    kernel()
    grid = tiny_model().prepare_grid(torch.tensor([[2, 2], [4, 6], [4, 6]]))
    q, k, v = (torch.randn(52, 4, 16) for _ in range(3))

    def reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        # lengths from the grid's Python ints (the reference's tolist() would break the graph)
        parts = zip(*(t.split(grid.seqlens) for t in (query, key, value)))
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in p), scale=scale) for p in parts]
        return torch.cat([o.transpose(0, 1) for o in out])

    kernel(reference)
    compiled = torch.compile(lambda q, k, v: attention.varlen_attention(q, k, v, grid), fullgraph=True)
    assert_close_across_shapes(compiled(q, k, v), attention.sdpa_attention(q, k, v, grid))
