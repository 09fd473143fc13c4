"""Parity with transformers' Kimi-K2.5 vision tower, the independent implementation
of the same MoonViT, its weights permuted by transformers' own PermuteForRope."""

import pytest
import torch
from helpers import FLEX, random_pack, tiny_model

pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
from moonvit.weights.transformers import to_transformers


def forward_both(model, theirs, pixels, grids):
    with torch.no_grad():
        ours = model(pixels, grids)
        thw = torch.cat([torch.ones(len(grids), 1, dtype=torch.int64), grids], dim=1)
        ref = theirs(pixels, thw)
    return ours, ref


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


PACKS = {
    "one image": [(8, 12)],
    "image above the table size": [(70, 66)],
    "mixed pack": [(2, 2), (6, 10), (4, 4), (66, 4), (2, 68), (4, 4)],
}


@pytest.mark.parametrize("pack", PACKS.values(), ids=PACKS.keys())
def test_float64_parity(pack):
    model = tiny_model(seed=1, dtype=torch.float64)
    theirs = to_transformers(model)
    pixels, grids = random_pack(pack, dtype=torch.float64)
    ours, ref = forward_both(model, theirs, pixels, grids)
    assert rel(ours.last_hidden_state, ref.last_hidden_state) < 1e-5
    assert rel(ours.merged, ref.pooler_output) < 1e-5


@pytest.mark.parametrize("impl", ["sdpa", FLEX])
def test_bfloat16_as_close_to_exact_as_transformers(impl):
    """In bf16 neither implementation matches the other bit for bit. The bound
    that matters: our bf16 output is no further from the float64 answer than
    transformers' bf16 output is (with 25% slack for rounding luck), and both
    stay within bf16's few-percent envelope after the blocks."""
    pack = PACKS["mixed pack"]
    exact_model = tiny_model(seed=2, dtype=torch.float64)
    pixels, grids = random_pack(pack, dtype=torch.float64)
    exact, _ = forward_both(exact_model, to_transformers(exact_model), pixels, grids)
    model = tiny_model(seed=2, dtype=torch.bfloat16, attn_implementation=impl)
    ours, ref = forward_both(model, to_transformers(model), pixels.bfloat16(), grids)
    ours_error = rel(ours.last_hidden_state, exact.last_hidden_state)
    theirs_error = rel(ref.last_hidden_state, exact.last_hidden_state)
    assert ours_error <= 1.25 * theirs_error + 1e-3
    assert ours_error < 0.03
    assert rel(ours.last_hidden_state, ref.last_hidden_state) < 0.05


@pytest.mark.parametrize("impl", ["sdpa", FLEX])
def test_float32_parity(impl):
    """flex has no float64 kernel: both fast backends against transformers in float32."""
    model = tiny_model(seed=1, attn_implementation=impl)
    pixels, grids = random_pack(PACKS["mixed pack"])
    ours, ref = forward_both(model, to_transformers(model), pixels, grids)
    assert rel(ours.last_hidden_state, ref.last_hidden_state) < 1e-5
    assert rel(ours.merged, ref.pooler_output) < 1e-5
