"""Linear layers with their epilogue (bias, tanh GELU, a residual add) fused on CPU.

In eager mode every elementwise step after a matmul is another pass over its
output: ``addmm`` first copies the broadcast bias into the output (a layer without one,
as in Kimi K3, fuses the rest all the same), GELU reads and
writes the (L, 4304) MLP activation once more, and each residual add reads two
(L, D) tensors and writes a third. oneDNN's linear runs the bias, the tanh GELU or
the residual add in the matmul's epilogue, on the float32 accumulator before the
one rounding to bf16. :func:`linear` uses it for bf16 inference on CPU and falls
back to the module's own forward everywhere else, so that:

- hooks, LoRA / quantised / pruned replacements of the module, autograd (training),
  ``torch.compile`` and ONNX export see the plain ``nn.Linear`` call they expect;
- other devices (CUDA's fused kernels are another matter), float32 and float64 run as before.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _module

__all__ = ["linear"]

# bf16 only: there the epilogue on the float32 accumulator saves a bf16 rounding of the
# intermediate as well as a pass. float32 keeps MKL's addmm, so an fp32 forward gives the same
# bits with autograd on and off (a frozen encoder inside a trained model).
_FUSED_DTYPES = (torch.bfloat16,)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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


def _fusable(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether the oneDNN call stands exactly for ``layer(x)`` followed by the epilogue."""
    return (
        _ONEDNN
        and type(layer) is nn.Linear
        and x.device.type == "cpu"
        and x.dtype in _FUSED_DTYPES
        and layer.weight.dtype == x.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad))
        and not (layer._forward_hooks or layer._forward_pre_hooks)
        and not (_module._global_forward_hooks or _module._global_forward_pre_hooks)
        and not torch.compiler.is_compiling()
        and not torch.onnx.is_in_onnx_export()
        and onednn_bf16_linear()
    )


def linear(
    layer: nn.Module, x: torch.Tensor, *, gelu_tanh: bool = False, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``layer(x)``, then tanh GELU (``gelu_tanh``) or ``residual + ...`` (not both).

    Args:
        layer: an ``nn.Linear`` (or a replacement of one: then its own forward runs).
        x: (rows, in_features).
        residual: (rows, out_features), added to the output.

    Returns:
        (rows, out_features) in ``x``'s dtype.
    """
    if gelu_tanh and residual is not None:
        raise ValueError("linear fuses a GELU or a residual add, not both")
    if _fusable(layer, x):
        pointwise = torch.ops.mkldnn._linear_pointwise
        assert isinstance(layer, nn.Linear)
        if residual is not None:
            return pointwise.binary(x, residual, layer.weight, layer.bias, "add")
        if gelu_tanh:
            return pointwise(x, layer.weight, layer.bias, "gelu", [], "tanh")
        return pointwise(x, layer.weight, layer.bias, "none", [], "")
    out = layer(x)
    if gelu_tanh:
        return F.gelu(out, approximate="tanh")
    return out if residual is None else residual + out
