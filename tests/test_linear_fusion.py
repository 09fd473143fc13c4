"""The CPU linear paths (moonvit.model.linear): oneDNN's fused bf16 epilogues and bf16 widened to
float32 give the plain layers' results to one bf16 rounding, and the plain module call runs wherever
something must see it (hooks, replacements, autograd, other dtypes)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import random_pack, tiny_model

import moonvit.model.linear as cpu_linear
from moonvit.model.linear import cpu_bf16_matmul, cpu_bf16_matmul_mode, linear, set_cpu_bf16_matmul
from moonvit_projector import MoonViTProjector, ProjectorConfig

needs_fusion = pytest.mark.skipif(
    not cpu_linear.onednn_bf16_linear(), reason="oneDNN's bf16 linear does not run here (no oneDNN, or no AVX-512)"
)
MODES = [pytest.param("bf16", marks=needs_fusion), "float32"]


@pytest.fixture
def mode(request):
    """Sets the CPU bf16 matmul mode for one test, then restores the one before."""
    previous = set_cpu_bf16_matmul(request.param)
    yield request.param
    set_cpu_bf16_matmul(previous)


def layer(n_in=48, n_out=40, seed=0, bias=True):
    torch.manual_seed(seed)
    out = nn.Linear(n_in, n_out, bias=bias)
    if bias:
        nn.init.normal_(out.bias)
    return out.bfloat16()


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias (K3)"])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "exact gelu", "residual"])
def test_epilogues_match_float32_math_to_one_bf16_rounding(mode, epilogue, bias):
    fc = layer(bias=bias)
    x = torch.randn(37, 48).bfloat16()
    residual = torch.randn(37, 40).bfloat16() if epilogue == "residual" else None
    gelu = {"gelu": "tanh", "exact gelu": "none"}.get(epilogue)
    with torch.no_grad():
        out = linear(fc, x, gelu=gelu, residual=residual)
        exact = F.linear(x.float(), fc.weight.float(), None if fc.bias is None else fc.bias.float())
        if gelu is not None:
            exact = F.gelu(exact, approximate=gelu)
        if residual is not None:
            exact = exact + residual.float()
    assert out.dtype == torch.bfloat16
    # one bf16 rounding of the float32 result (2^-8 relative), nothing more
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_hooks_replacements_autograd_and_float32_take_the_module_call(mode, monkeypatch):
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
        linear(lora, x, gelu="tanh")
    out = linear(layer(), x.clone().requires_grad_(True))  # autograd on and needed
    out.sum().backward()
    with torch.no_grad():
        linear(layer().float(), x.float())  # float32 keeps addmm
    assert calls == ["hook", "lora"]


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_bf16_encoder_with_and_without_the_cpu_paths_agree(mode, monkeypatch):
    model = tiny_model(dtype=torch.bfloat16)
    pixels, grids = random_pack([(4, 6), (2, 2), (8, 8)], dtype=torch.bfloat16)
    with torch.inference_mode():
        fast = model(pixels, grids).last_hidden_state
        monkeypatch.setattr(cpu_linear, "_plain_inference_call", lambda layer, x: False)
        plain = model(pixels, grids).last_hidden_state
    assert (fast.float() - plain.float()).abs().max() < 0.1  # a few bf16 steps after two blocks
    assert not torch.equal(fast, plain)  # the CPU path did run


@pytest.mark.parametrize("mode", ["float32"], indirect=True)
def test_float32_path_without_onednn_is_the_same_arithmetic(mode, monkeypatch):
    """Without oneDNN the widened call is F.linear, then the epilogue, in float32."""
    fc, x, residual = layer(), torch.randn(9, 48).bfloat16(), torch.randn(9, 40).bfloat16()
    monkeypatch.setattr(cpu_linear, "_ONEDNN", False)
    with torch.no_grad():
        wide = F.linear(x.float(), fc.weight.float(), fc.bias.float())
        assert torch.equal(linear(fc, x), wide.bfloat16())
        assert torch.equal(linear(fc, x, gelu="tanh"), F.gelu(wide, approximate="tanh").bfloat16())
        assert torch.equal(linear(fc, x, gelu="none"), F.gelu(wide).bfloat16())
        assert torch.equal(linear(fc, x, residual=residual), (wide + residual.float()).bfloat16())


def test_auto_widens_bf16_only_where_the_cpu_has_no_bf16_arithmetic(monkeypatch):
    for hardware, expected in ((True, "bf16"), (False, "float32")):
        monkeypatch.setattr(cpu_linear, "cpu_has_bf16_arithmetic", lambda hardware=hardware: hardware)
        assert cpu_bf16_matmul() == expected
        assert cpu_linear.computes_in_float32(torch.ones(1, dtype=torch.bfloat16)) is (expected == "float32")
    assert not cpu_linear.computes_in_float32(torch.ones(1))  # float32 layers are left alone
    previous = set_cpu_bf16_matmul("bf16")
    try:
        assert cpu_bf16_matmul() == "bf16"  # a choice by hand wins over the host
    finally:
        assert set_cpu_bf16_matmul(previous) == "bf16"
    with pytest.raises(ValueError, match="auto, bf16, float32.*'fp16'"):
        set_cpu_bf16_matmul("fp16")


def test_the_mode_takes_the_command_lines_spelling_fp32():
    """``fp32`` (as every ``--dtype`` spells it) is ``float32``; the name kept is the canonical one."""
    previous = set_cpu_bf16_matmul("fp32")
    try:
        assert cpu_bf16_matmul() == "float32"
        assert set_cpu_bf16_matmul("bfloat16") == "float32"
        assert cpu_bf16_matmul() == "bf16"
    finally:
        set_cpu_bf16_matmul(previous)


def test_the_mode_context_manager_restores_the_previous_mode():
    previous = set_cpu_bf16_matmul("bf16")
    try:
        with cpu_bf16_matmul_mode("fp32") as mode:
            assert mode == cpu_bf16_matmul() == "float32"
            with cpu_bf16_matmul_mode("auto"):
                assert cpu_bf16_matmul() == ("bf16" if cpu_linear.cpu_has_bf16_arithmetic() else "float32")
            assert cpu_bf16_matmul() == "float32"  # the inner block restored the outer one's mode
        assert cpu_bf16_matmul() == "bf16"
        with pytest.raises(RuntimeError, match="inside"), cpu_bf16_matmul_mode("float32"):
            raise RuntimeError("inside")
        assert cpu_bf16_matmul() == "bf16"  # restored after an exception too
        with pytest.raises(ValueError, match="'fp16'"), cpu_bf16_matmul_mode("fp16"):
            pass
        assert cpu_bf16_matmul() == "bf16"  # a refused mode changes nothing
    finally:
        set_cpu_bf16_matmul(previous)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_bf16_projector_matches_its_float32_math(mode):
    torch.manual_seed(0)
    config = ProjectorConfig(vision_hidden_size=32, merge_kernel_size=(2, 2), text_hidden_size=24)
    projector = MoonViTProjector(config).eval()
    merged = torch.randn(2, 5, 4, 32)
    with torch.no_grad():
        exact = projector(merged)
        out = projector.to(torch.bfloat16)(merged)
    assert out.shape == (2, 5, 24) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, rtol=0.05, atol=0.05)  # bf16 weights and activations


def test_hosts_where_onednn_cannot_build_the_bf16_primitive_take_the_module_call(monkeypatch):
    """On an AVX2-only CPU (or ONEDNN_MAX_CPU_ISA=AVX2) oneDNN raises for a bf16 inner product:
    the probe says no, and with bf16 kernels chosen every call is the plain layer's."""
    monkeypatch.setattr(cpu_linear, "onednn_bf16_linear", lambda: False)
    monkeypatch.setattr(cpu_linear, "_cpu_bf16_matmul", "bf16")
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", None)  # any use of it would fail
    fc, x = layer(), torch.randn(5, 48).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(linear(fc, x, gelu="tanh"), F.gelu(fc(x), approximate="tanh"), rtol=0, atol=0)
