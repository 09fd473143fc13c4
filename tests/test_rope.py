import pytest
import torch

from moonvit.model import rope
from moonvit.model.rope import apply_rope, apply_rope_, rope_frequencies, rope_rotation


def test_frequencies_of_the_released_head_dim():
    freqs = rope_frequencies(72, 10000.0)
    assert freqs.shape == (18,) and freqs.dtype == torch.float32
    expected = torch.tensor([10000.0 ** (-k / 72) for k in range(0, 72, 4)])
    torch.testing.assert_close(freqs, expected)


def test_column_rotates_even_pairs_row_rotates_odd_pairs():
    head_dim = 8  # two frequencies: 1 and 10000 ** -0.5
    x = torch.zeros(2, 1, head_dim)
    x[..., 0::2] = 1.0  # every complex pair = 1 + 0j
    positions = torch.tensor([[0, 3], [2, 0]])  # (row 0, col 3) and (row 2, col 0)
    out = apply_rope(x, rope_rotation(positions, head_dim, 10000.0)).view(2, 4, 2)
    angles = torch.atan2(out[..., 1], out[..., 0])
    f1 = 10000.0**-0.5
    torch.testing.assert_close(angles[0], torch.tensor([3.0, 0.0, 3.0 * f1, 0.0]))
    torch.testing.assert_close(angles[1], torch.tensor([0.0, 2.0, 0.0, 2.0 * f1]))


def test_matches_complex_multiplication():
    head_dim, heads = 72, 3
    positions = torch.stack(torch.meshgrid(torch.arange(9), torch.arange(13), indexing="ij"), -1).reshape(-1, 2)
    x = torch.randn(len(positions), heads, head_dim)
    freqs = rope_frequencies(head_dim, 10000.0)
    angle = torch.stack([positions[:, 1:].float() * freqs, positions[:, :1].float() * freqs], -1).flatten(1)
    expected = torch.view_as_real(
        torch.view_as_complex(x.reshape(-1, heads, head_dim // 2, 2))
        * torch.polar(torch.ones_like(angle), angle)[:, None]
    ).reshape(x.shape)
    torch.testing.assert_close(apply_rope(x, rope_rotation(positions, head_dim, 10000.0)), expected)


def test_low_precision_is_rotated_in_float32_and_cast_back():
    positions = torch.tensor([[5, 7], [511, 511]])
    x = torch.randn(2, 2, 16).bfloat16()
    rotation = rope_rotation(positions, 16, 10000.0)
    out = apply_rope(x, rotation)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, apply_rope(x.float(), rotation).bfloat16())


def test_real_form_and_q_k_together():
    """The complex multiply equals the real rotation formula, for q and k stacked as (L, 2, H, d)."""
    positions = torch.tensor([[3, 4], [0, 9], [17, 2]])
    qk = torch.randn(3, 2, 5, 8, dtype=torch.float64)
    freqs = rope_frequencies(8, 10000.0).double()
    angle = torch.stack([positions[:, 1:] * freqs, positions[:, :1] * freqs], -1).flatten(1)[:, None, None]
    real, imag = qk[..., 0::2], qk[..., 1::2]
    expected = torch.stack([real * angle.cos() - imag * angle.sin(), real * angle.sin() + imag * angle.cos()], -1)
    torch.testing.assert_close(apply_rope(qk, rope_rotation(positions, 8, 10000.0)), expected.flatten(-2))


def test_rotation_preserves_norm_at_large_positions():
    positions = torch.tensor([[511, 0], [0, 511], [300, 200]])
    x = torch.randn(3, 4, 72, dtype=torch.float64)
    out = apply_rope(x, rope_rotation(positions, 72, 10000.0))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_the_real_form_used_by_compilers_and_exporters_equals_the_complex_one():
    from moonvit.model.rope import rotate_real

    positions = torch.stack(torch.meshgrid(torch.arange(7), torch.arange(11), indexing="ij"), -1).reshape(-1, 2)
    rotation = rope_rotation(positions, 72, 10000.0)
    assert rotation.dtype == torch.float32 and rotation.shape == (77, 36, 2)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        x = torch.randn(77, 2, 3, 72, dtype=dtype)
        torch.testing.assert_close(rotate_real(x, rotation, torch.promote_types(dtype, torch.float32)),
                                   apply_rope(x, rotation), rtol=tolerance, atol=tolerance)  # fmt: skip
    x = torch.randn(77, 3, 72).bfloat16()
    # bf16: both round the same float32 values once, up to the last float32 bit of a product
    assert (rotate_real(x, rotation).float() - apply_rope(x, rotation).float()).abs().max() <= 2**-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_rotating_in_place_gives_the_copy_s_bits(dtype, monkeypatch):
    """apply_rope_ overwrites the q and k of a qkv buffer with apply_rope's bits, over chunk
    boundaries (a chunk of 7 rows, 50 rows), and leaves v alone."""
    monkeypatch.setattr(
        rope, "IN_PLACE_CHUNK_BYTES", 7 * 2 * 3 * 8 * torch.promote_types(dtype, torch.float32).itemsize
    )
    qkv = torch.randn(50, 3, 3, 8, dtype=torch.float64).to(dtype)
    rotation = rope_rotation(torch.randint(0, 40, (50, 2)), 8, 10000.0)
    expected, v = apply_rope(qkv[:, :2], rotation), qkv[:, 2].clone()
    out = apply_rope_(qkv[:, :2], rotation)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, :2], expected) and torch.equal(qkv[:, 2], v)


def test_rotating_what_autograd_records_returns_a_copy():
    qkv = torch.randn(6, 3, 2, 8, requires_grad=True)
    rotation = rope_rotation(torch.randint(0, 5, (6, 2)), 8, 10000.0)
    before = qkv.detach().clone()
    out = apply_rope_(qkv[:, :2], rotation)
    assert torch.equal(qkv.detach(), before)
    assert torch.equal(out, apply_rope(qkv[:, :2], rotation))
    out.sum().backward()
    assert qkv.grad is not None and qkv.grad[:, 2].abs().sum() == 0


def test_rotating_in_place_takes_the_scaled_query_rotation_and_empty_packs():
    """scale_query's (L, 2, 1, P, 2) rotation, in place as in the copy: q's rows of factor 1 and k keep
    the plain rotation's bits, q's scaled rows are the plain rotation times the factor (to a bf16
    rounding); a pack of no rows is left as it is."""
    qkv = torch.randn(20, 3, 2, 8).bfloat16()
    rotation = rope_rotation(torch.randint(0, 10, (20, 2)), 8, 10000.0)
    factor = torch.where(torch.arange(20) < 12, torch.tensor(8**-0.5), torch.tensor(1.0))
    scaled = rope.scale_query(rotation, factor)
    plain, expected = apply_rope(qkv[:, :2], rotation), apply_rope(qkv[:, :2], scaled)
    apply_rope_(qkv[:, :2], scaled)
    assert torch.equal(qkv[:, :2], expected)
    assert torch.equal(qkv[:, 1], plain[:, 1]) and torch.equal(qkv[12:, 0], plain[12:, 0])
    torch.testing.assert_close(qkv[:12, 0].float(), plain[:12, 0].float() * 8**-0.5, rtol=8e-3, atol=1e-6)
    empty = torch.empty(0, 3, 2, 8).bfloat16()
    assert apply_rope_(empty[:, :2], rotation[:0]).shape == (0, 2, 2, 8)
