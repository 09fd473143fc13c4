"""The CPU epilogue fusion (moonvit.model.linear): same results as the plain layers, and the
plain module call wherever something must see it (hooks, replacements, autograd, other dtypes)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import random_pack, tiny_model

import moonvit.model.linear as fused_linear
from moonvit.model.linear import linear

needs_fusion = pytest.mark.skipif(
    not fused_linear.onednn_bf16_linear(), reason="oneDNN's bf16 linear does not run here (no oneDNN, or no AVX-512)"
)


def layer(n_in=48, n_out=40, seed=0, bias=True):
    torch.manual_seed(seed)
    out = nn.Linear(n_in, n_out, bias=bias)
    if bias:
        nn.init.normal_(out.bias)
    return out.bfloat16()


@needs_fusion
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias (K3)"])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "residual"])
def test_fused_epilogues_match_float32_math_to_bf16_rounding(epilogue, bias):
    fc = layer(bias=bias)
    x = torch.randn(37, 48).bfloat16()
    residual = torch.randn(37, 40).bfloat16() if epilogue == "residual" else None
    with torch.no_grad():
        out = linear(fc, x, gelu_tanh=epilogue == "gelu", residual=residual)
        exact = F.linear(x.float(), fc.weight.float(), None if fc.bias is None else fc.bias.float())
        if epilogue == "gelu":
            exact = F.gelu(exact, approximate="tanh")
        if residual is not None:
            exact = exact + residual.float()
    assert out.dtype == torch.bfloat16
    # one bf16 rounding of the float32 result (2^-8 relative), nothing more
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-3)


@needs_fusion
def test_hooks_replacements_autograd_and_float32_take_the_module_call(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", None)  # any use of it would fail
    fc = layer()
    x = torch.randn(5, 48).bfloat16()
    handle = fc.register_forward_hook(lambda module, args, out: calls.append("hook"))
    with torch.no_grad():
        linear(fc, x)
    handle.remove()

    class LoRALinear(nn.Linear):
        def forward(self, x):
            calls.append("lora")
            return super().forward(x)

    lora = LoRALinear(48, 40).bfloat16()
    with torch.no_grad():
        linear(lora, x, gelu_tanh=True)
    out = linear(layer(), x.clone().requires_grad_(True))  # autograd on and needed
    out.sum().backward()
    with torch.no_grad():
        linear(layer().float(), x.float())  # float32 keeps addmm
    assert calls == ["hook", "lora"]


@needs_fusion
def test_bf16_encoder_with_and_without_fusion_agree(monkeypatch):
    model = tiny_model(dtype=torch.bfloat16)
    pixels, grids = random_pack([(4, 6), (2, 2), (8, 8)], dtype=torch.bfloat16)
    with torch.inference_mode():
        fused = model(pixels, grids).last_hidden_state
        monkeypatch.setattr(fused_linear, "_ONEDNN", False)
        plain = model(pixels, grids).last_hidden_state
    assert (fused.float() - plain.float()).abs().max() < 0.1  # a few bf16 steps after two blocks
    assert not torch.equal(fused, plain)  # the fused path did run


def test_hosts_where_onednn_cannot_build_the_bf16_primitive_take_the_module_call(monkeypatch):
    """On an AVX2-only CPU (or ONEDNN_MAX_CPU_ISA=AVX2) oneDNN raises for a bf16 inner product:
    the probe says no, and every call is the plain layer's."""
    monkeypatch.setattr(fused_linear, "onednn_bf16_linear", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", None)  # any use of it would fail
    fc, x = layer(), torch.randn(5, 48).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(linear(fc, x, gelu_tanh=True), F.gelu(fc(x), approximate="tanh"), rtol=0, atol=0)
