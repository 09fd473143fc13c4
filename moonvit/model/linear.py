"""Linear layers on CPU: the epilogue fused, and bf16 computed in float32 where the CPU has no bf16 arithmetic.

In eager mode every elementwise step after a matmul is another pass over its
output: ``addmm`` first copies the broadcast bias into the output (a layer without one,
as in Kimi K3, fuses the rest all the same), GELU reads and
writes the (L, 4304) MLP activation once more, and each residual add reads two
(L, D) tensors and writes a third. oneDNN's linear runs the bias, the tanh GELU or
the residual add in the matmul's epilogue, on the float32 accumulator before the
one rounding to bf16. :func:`linear` uses it for bf16 inference on CPU.

An x86 CPU without AVX512-BF16 or AMX (AMD before Zen 4, Intel before Cooper Lake and
Sapphire Rapids) has no bf16 arithmetic: oneDNN and torch emulate a bf16 matmul at about a
quarter of the float32 GEMM's rate (57 against 230 GFLOP/s on an AVX-512 Xeon, 2 threads).
There :func:`linear` widens the bf16 input and weight to float32 (exact: every bf16 value is
a float32 value), runs the float32 GEMM with the same epilogue and rounds the result to bf16
once: the arithmetic of the bf16 kernel (products summed in float32, one rounding at the
end), in the order of another GEMM. The weight is widened per call, not kept (that would
cost the memory bf16 weights save); :func:`set_cpu_bf16_matmul` chooses the path by hand, for the
whole process, and :func:`cpu_bf16_matmul_mode` for the length of a ``with`` block.

Everywhere else :func:`linear` is the module's own forward, so that:

- hooks, LoRA / quantised / pruned replacements of the module, autograd (training),
  ``torch.compile`` and ONNX export see the plain ``nn.Linear`` call they expect;
- other devices (CUDA's fused kernels are another matter), float32 and float64 run as before.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _module

from .tracing import recorded_or_traced

__all__ = [
    "CPU_BF16_MATMUL_MODES",
    "computes_in_float32",
    "cpu_bf16_matmul",
    "cpu_bf16_matmul_mode",
    "has_forward_hooks",
    "linear",
    "set_cpu_bf16_matmul",
]

# bf16 only: there the epilogue on the float32 accumulator saves a bf16 rounding of the
# intermediate as well as a pass. float32 keeps MKL's addmm, so an fp32 forward gives the same
# bits with autograd on and off (a frozen encoder inside a trained model).
_FUSED_DTYPES = (torch.bfloat16,)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

CPU_BF16_MATMUL_MODES = ("auto", "bf16", "float32")
"""How bf16 linears run on CPU: ``auto`` (float32 where the CPU has no bf16 arithmetic), ``bf16``
(oneDNN's or torch's bf16 kernels, emulated or not), ``float32`` (widened, then rounded once).
The command lines' dtype spellings are accepted too: ``fp32`` / ``f32`` for ``float32``, ``bfloat16``
for ``bf16``."""
_MODE_SPELLINGS = {"fp32": "float32", "f32": "float32", "bfloat16": "bf16"}
_cpu_bf16_matmul = "auto"


def set_cpu_bf16_matmul(mode: str) -> str:
    """Choose how bf16 linears of the encoder and projector run in CPU inference, for the whole
    process; one of :data:`CPU_BF16_MATMUL_MODES` (``auto`` at import) or another spelling of one.
    Returns the mode it replaces (by its name in :data:`CPU_BF16_MATMUL_MODES`)."""
    global _cpu_bf16_matmul
    name = _MODE_SPELLINGS.get(mode, mode)
    if name not in CPU_BF16_MATMUL_MODES:
        raise ValueError(
            f"the CPU bf16 matmul mode must be one of {', '.join(CPU_BF16_MATMUL_MODES)} (or fp32), got {mode!r}"
        )
    previous, _cpu_bf16_matmul = _cpu_bf16_matmul, name
    return previous


@contextmanager
def cpu_bf16_matmul_mode(mode: str) -> Iterator[str]:
    """``with cpu_bf16_matmul_mode("float32"): ...``: :func:`set_cpu_bf16_matmul` for the block, the
    previous mode restored after it (on an exception too). Yields the mode in effect, ``auto``
    resolved. The mode stays one setting of the process: other threads see it during the block."""
    previous = set_cpu_bf16_matmul(mode)
    try:
        yield cpu_bf16_matmul()
    finally:
        set_cpu_bf16_matmul(previous)


def cpu_bf16_matmul() -> str:
    """How bf16 linears run in CPU inference now: ``"bf16"`` or ``"float32"`` (``auto`` resolved)."""
    if _cpu_bf16_matmul == "auto":
        return "bf16" if cpu_has_bf16_arithmetic() else "float32"
    return _cpu_bf16_matmul


@functools.cache
def cpu_units() -> tuple[bool, bool]:
    """(AMX, AVX512-BF16) as torch reads them; False where this torch cannot tell."""
    amx, bf16 = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return amx is not None and bool(amx()), bf16 is not None and bool(bf16())


@functools.cache
def cpu_has_bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bf16 in hardware. On x86: AVX512-BF16 or AMX, as torch reads
    them. Other architectures are taken to have it (their bf16 kernels are left as they are)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    found = [getattr(torch.cpu, name, None) for name in checks]
    if not any(found):  # a torch without the queries: keep its own kernels
        return True
    return any(check is not None and bool(check()) for check in found)


@functools.cache
def onednn_bf16_linear() -> bool:
    """Whether oneDNN's fused bf16 linear runs on this host. It needs AVX-512 (or AMX): on an
    AVX2-only CPU, or with ``ONEDNN_MAX_CPU_ISA`` set below AVX-512, oneDNN cannot build the
    primitive and raises, so it is tried once on a tiny input before it is ever used."""
    if not _ONEDNN:
        return False
    x, weight = torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(8, 16, dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    except RuntimeError:
        return False
    return bool((out == 16).all())


def computes_in_float32(x: torch.Tensor) -> bool:
    """Whether a bf16 linear on ``x`` runs widened to float32 (a CPU without bf16 arithmetic, or
    ``set_cpu_bf16_matmul("float32")``), so its temporaries take 4 bytes per value."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and cpu_bf16_matmul() == "float32"


def _plain_inference_call(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether nothing needs to see ``layer(x)`` as a module call: a plain ``nn.Linear`` in the input's
    dtype, no autograd, no hooks, no tracing."""
    return (
        type(layer) is nn.Linear
        and layer.weight.dtype == x.dtype
        and not recorded_or_traced(x, layer.weight)
        and not has_forward_hooks(layer)
    )


def has_forward_hooks(layer: nn.Module) -> bool:
    """Whether a forward hook or pre-hook sees ``layer``'s calls: its own, or a global one
    (``torch.nn.modules.module.register_module_forward_hook`` and its pre-hook twin)."""
    return bool(
        layer._forward_hooks
        or layer._forward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
    )


def _linear_epilogue(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: str | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias``, then GELU (``gelu``: ``"tanh"`` or ``"none"``, exact) or ``+ residual``:
    oneDNN's fused call where it exists."""
    if _ONEDNN:
        pointwise = torch.ops.mkldnn._linear_pointwise
        if residual is not None:
            return pointwise.binary(x, residual, weight, bias, "add")
        if gelu is not None:
            return pointwise(x, weight, bias, "gelu", [], gelu)
        return pointwise(x, weight, bias, "none", [], "")
    out = F.linear(x, weight, bias)
    if gelu is not None:
        return F.gelu(out, approximate=gelu)
    return out if residual is None else out.add_(residual)


def linear(
    layer: nn.Module, x: torch.Tensor, *, gelu: str | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``layer(x)``, then GELU or ``residual + ...`` (not both).

    Args:
        layer: an ``nn.Linear`` (or a replacement of one: then its own forward runs).
        x: (rows, in_features).
        gelu: ``"tanh"`` (MoonViT's) or ``"none"`` (the exact erf GELU, the classic ViT's), as
            ``F.gelu``'s ``approximate``; None: no activation.
        residual: (rows, out_features), added to the output.

    Returns:
        (rows, out_features) in ``x``'s dtype.
    """
    if gelu is not None and residual is not None:
        raise ValueError("linear fuses a GELU or a residual add, not both")
    if gelu not in (None, "tanh", "none"):
        raise ValueError(f"gelu must be 'tanh', 'none' (exact) or None, got {gelu!r}")
    if x.device.type == "cpu" and x.dtype in _FUSED_DTYPES and _plain_inference_call(layer, x):
        assert isinstance(layer, nn.Linear)
        if computes_in_float32(x):
            bias = None if layer.bias is None else layer.bias.float()
            wide = None if residual is None else residual.float()
            return _linear_epilogue(x.float(), layer.weight.float(), bias, gelu, wide).to(x.dtype)
        if onednn_bf16_linear():
            return _linear_epilogue(x, layer.weight, layer.bias, gelu, residual)
    out = layer(x)
    if gelu is not None:
        return F.gelu(out, approximate=gelu)
    return out if residual is None else residual + out
