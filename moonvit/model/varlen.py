"""torch's own varlen FlashAttention over a whole pack: the packed call without the flash-attn package.

``torch.nn.attention.varlen.varlen_attn`` (torch 2.10 and later) runs the FlashAttention-2 kernel
built into torch on the packed (L, heads, head_dim) rows, the items delimited by int32
``cu_seqlens``: one call per pack, however many sizes it holds, forward and backward, bf16 and fp16,
on CUDA (SM80 and later) and ROCm. It is the call the ``flash_attention_2`` backend makes through
flash-attn, for the many hosts where that source build is not installed; the backend ``varlen``
(:mod:`moonvit.model.attention`) is ``auto``'s choice there.

What it takes from the pack is computed once per pack, as for flash-attn: ``grid.cu_seqlens``
(already int32 on the model's device) and ``grid.max_seqlen``, a Python int, as the kernel requires
(a tensor there would be read back from the device every call, and ``torch.compile`` needs it
static). Two traps of the kernel are handled here:

- its backward returns NaN gradients when the packed tensors have more rows than
  ``cu_seqlens[-1]`` (rows after the last item), so the row count is checked against the pack's
  before every call, from Python ints (no device read);
- its signature changed: torch 2.10 takes ``is_causal``, later versions ``window_size`` and
  ``scale``. The keywords are chosen from the installed function's own signature, once.

Head dims: the kernel's backward takes multiples of 8 up to 256 (every family's 64, 72 and 128);
on another head_dim the backend runs ``sdpa`` and says why once, rather than fail in the kernel.
There is no CPU kernel, and no fp32 one: the backend is refused there with the reason.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .grid import PackedGrid

VARLEN_DTYPES = (torch.bfloat16, torch.float16)
VARLEN_MAX_HEAD_DIM = 256
_POSITIONAL = ("cu_seq_q", "cu_seq_k", "max_q", "max_k")
"""Parameters every known version takes, by these names, after q, k and v."""


_found: dict[str, Any] = {}
"""What :func:`varlen_not_installed` (``module``), :func:`varlen_kernel` (``kernel``) and the GPU
generation check (``capability <index>``) found, once per process: a plain dict, not
``functools.cache``, which ``torch.compile`` would trace through on every compile (and warn about);
the dict it reads as it is."""


def varlen_not_installed() -> str | None:
    """Why this torch has no ``torch.nn.attention.varlen``, or None (a lookup, not an import: the
    module takes seconds to import, and only a CUDA model needs it)."""
    if "module" not in _found:
        missing = importlib.util.find_spec("torch.nn.attention.varlen") is None
        _found["module"] = (
            f"it needs torch.nn.attention.varlen (torch >= 2.10), this is torch {torch.__version__}"
            if missing
            else None
        )
    return _found["module"]


def varlen_kernel() -> tuple[Callable[..., Any], frozenset[str]] | str:
    """``varlen_attn`` and the names of its parameters, or why it cannot be called (looked up once)."""
    if "kernel" not in _found:
        _found["kernel"] = _import_kernel()
    return _found["kernel"]


def _import_kernel() -> tuple[Callable[..., Any], frozenset[str]] | str:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        return f"torch.nn.attention.varlen does not import: {error}"
    names = frozenset(inspect.signature(varlen_attn).parameters)
    if not names.issuperset(_POSITIONAL):
        return f"this torch's varlen_attn takes ({', '.join(sorted(names))}), not the packed call expected"
    return varlen_attn, names


def varlen_keywords(names: frozenset[str], head_dim: int) -> dict[str, Any]:
    """The keywords for a non-causal call with the scale ``head_dim ** -0.5``, for a ``varlen_attn``
    whose parameters are ``names``: ``is_causal=False`` (torch 2.10), ``window_size=(-1, -1)`` and
    ``scale`` (later). A version without ``scale`` applies that same scale itself."""
    keywords: dict[str, Any] = {}
    if "is_causal" in names:
        keywords["is_causal"] = False
    if "window_size" in names:
        keywords["window_size"] = (-1, -1)
    if "scale" in names:
        keywords["scale"] = head_dim**-0.5
    return keywords


def varlen_head_dim_unsupported(head_dim: int) -> str | None:
    """Why the kernel does not take heads of ``head_dim`` (forward and backward), or None."""
    if head_dim % 8 or head_dim > VARLEN_MAX_HEAD_DIM:
        return f"torch's varlen_attn takes a head_dim that is a multiple of 8 up to 256, the model's is {head_dim}"
    return None


def varlen_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``varlen_attn`` cannot run for a model on ``device`` in ``dtype``, or None."""
    if device.type != "cuda":
        return f"torch's varlen_attn runs on CUDA, the model is on {device.type}"
    if dtype not in VARLEN_DTYPES:
        return f"torch's varlen_attn runs in bf16 or fp16, the model is {dtype}"
    kernel = varlen_kernel()
    if isinstance(kernel, str):
        return kernel
    capability = _capability(device)
    if capability is not None and capability < (8, 0):
        major, minor = capability
        return f"torch's varlen_attn needs an SM80 or newer GPU (its FlashAttention), this one is sm_{major}{minor}"
    return None


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability (asked once per device), or None where none is visible,
    on ROCm (whose numbering is another) or under ``torch.compile`` before an eager call asked (a
    tracer cannot follow the query; the kernel itself then refuses an older GPU)."""
    key = f"capability {device.index}"
    if key not in _found:
        if torch.compiler.is_compiling():
            return None
        visible = torch.version.hip is None and torch.cuda.is_available()
        _found[key] = torch.cuda.get_device_capability(device) if visible else None
    return _found[key]


def varlen_arguments(q: torch.Tensor, grid: PackedGrid) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` and the longest item for a call on ``q``'s packed rows, from ``grid``.

    Args:
        q: (L, heads, head_dim) packed rows.
        grid: the pack; its ``cu_seqlens`` (N + 1,) int32 end at L.

    Returns:
        cu_seqlens (N + 1,) int32 on q's device (the grid's own tensor where it is there already),
        and the longest item's length as a Python int.

    Raises:
        ValueError: q's rows are not the pack's: the kernel would attend past the last item, and its
            backward give NaN gradients there.
    """
    rows = grid.num_patches  # sum of Python ints: no device read
    if q.shape[0] != rows:
        raise ValueError(
            f"varlen attention got {q.shape[0]} packed rows for a pack of {rows} (cu_seqlens[-1]): "
            "rows beyond the last item would get NaN gradients from torch's varlen_attn"
        )
    cu_seqlens = grid.cu_seqlens
    if cu_seqlens.device != q.device or cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(q.device, torch.int32)
    return cu_seqlens, grid.max_seqlen


def packed_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
    """Block-diagonal attention over the pack in one ``varlen_attn`` call (head_dim checked by the
    caller, :func:`varlen_head_dim_unsupported`).

    Args:
        q, k, v: (L, heads, head_dim) bf16 or fp16 CUDA rows, head_dim contiguous (the block's views
            of its qkv buffer go in as they are, as they do to flash-attn's kernel).

    Returns:
        (L, heads, head_dim).
    """
    kernel = varlen_kernel()
    if isinstance(kernel, str):
        raise RuntimeError(kernel)
    attend, names = kernel
    cu_seqlens, max_seqlen = varlen_arguments(q, grid)
    return attend(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **varlen_keywords(names, q.shape[-1]))
