"""Whether a call runs eagerly, for the fast paths that only eager PyTorch takes.

In-place RoPE, RoPE through complex tensors, the fused linear epilogues and OpenVINO's attention
are eager-only: autograd must see out-of-place ops, and neither ``torch.compile`` nor ONNX export
traces complex tensors or foreign runtimes. The position table's cache is too: a traced graph would
keep a cached table as a constant. Each such path asks here and steps aside.
"""

from __future__ import annotations

import torch


def is_traced() -> bool:
    """Whether ``torch.compile`` or ONNX export is tracing this call."""
    return torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export()


def recorded_or_traced(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensors`` or a tracer sees it (:func:`is_traced`)."""
    return is_traced() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
