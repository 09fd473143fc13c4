"""Attention over a pack of images, each image attending only to itself.

Three backends compute the same block-diagonal attention:

- ``flash_attention_2``: flash-attn's varlen kernel over the packed sequence
  (CUDA, bf16 / fp16; the optional ``moonvit[flash]`` extra).
- ``sdpa``: torch's ``scaled_dot_product_attention``, one batched call per group
  of equally long images. No (L, L) mask is ever built, so memory grows with the
  total number of patches, not its square.
- ``eager``: plain math per image, the reference.

``auto`` picks flash-attn where it can run and otherwise falls back to sdpa.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from .config import ATTN_IMPLEMENTATIONS
from .grid import AttentionGroup, PackedGrid

logger = logging.getLogger("moonvit")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PackedGrid], torch.Tensor]
FLASH_DTYPES = (torch.bfloat16, torch.float16)
_FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None
_logged_fallbacks: set[str] = set()


def flash_attn_installed() -> bool:
    return _FLASH_ATTN_INSTALLED


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
    """Reference attention: softmax(q k^T / sqrt(d)) v per image, softmax in float32.

    Args:
        q, k, v: (L, heads, head_dim).

    Returns:
        (L, heads, head_dim) in q's dtype.
    """
    scale = q.shape[-1] ** -0.5
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    outputs = []
    for q_i, k_i, v_i in zip(*(t.split(grid.seqlens) for t in (q, k, v))):
        scores = torch.einsum("qhd,khd->hqk", q_i, k_i).to(compute_dtype) * scale
        probs = scores.softmax(dim=-1).to(v_i.dtype)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v_i))
    return torch.cat(outputs)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
    """Block-diagonal attention with ``F.scaled_dot_product_attention``.

    Images of equal length form one (images, heads, seqlen, head_dim) batch, so
    32 small images cost one call, not 32, and nothing is padded. Consecutive
    images are read as views of the packed rows; others are gathered.
    """
    groups = grid.attention_groups
    if len(groups) == 1 and groups[0].start is not None:
        return _sdpa_group(q, k, v, groups[0], slice(None))
    out = q.new_empty(q.shape)
    for group in groups:
        if group.start is not None:
            rows = slice(group.start, group.start + group.num_images * group.seqlen)
            out[rows] = _sdpa_group(q, k, v, group, rows)
        else:
            out[group.token_index.flatten()] = _sdpa_group(q, k, v, group, group.token_index)
    return out


def _sdpa_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup, rows) -> torch.Tensor:
    """Attention of one group; ``rows`` selects its packed rows. Returns (images * seqlen, heads, head_dim)."""
    if isinstance(rows, torch.Tensor):
        q, k, v = (t.index_select(0, rows.flatten()) for t in (q, k, v))
    else:
        q, k, v = (t[rows] for t in (q, k, v))
    batch = [t.reshape(group.num_images, group.seqlen, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*batch).transpose(1, 2).flatten(0, 1)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
    """flash-attn's varlen kernel on the packed (L, heads, head_dim) sequence."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=grid.cu_seqlens,
        cu_seqlens_k=grid.cu_seqlens,
        max_seqlen_q=grid.max_seqlen,
        max_seqlen_k=grid.max_seqlen,
        softmax_scale=q.shape[-1] ** -0.5,
        causal=False,
    )


ATTENTION_FUNCTIONS: dict[str, AttentionFn] = {
    "flash_attention_2": flash_attention,
    "sdpa": sdpa_attention,
    "eager": eager_attention,
}


def check_attn_implementation(name: str) -> None:
    """Raise early for a backend that is unknown or cannot be installed here."""
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {name!r}")
    if name == "flash_attention_2" and not flash_attn_installed():
        raise RuntimeError("attn_implementation='flash_attention_2' needs flash-attn (pip install 'moonvit[flash]')")


def _flash_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if not flash_attn_installed():
        return "flash-attn is not installed (pip install 'moonvit[flash]')"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, the model is on {device.type}"
    if dtype not in FLASH_DTYPES:
        return f"flash-attn needs bf16 or fp16, the model is {dtype}"
    return None


def resolve_attn_implementation(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to run for a model on ``device`` in ``dtype``.

    Raises:
        RuntimeError: ``flash_attention_2`` was asked for where it cannot run.
    """
    if requested in ("sdpa", "eager"):
        return requested
    reason = _flash_unavailable_reason(device, dtype)
    if reason is None:
        return "flash_attention_2"
    if requested == "flash_attention_2":
        raise RuntimeError(f"attn_implementation='flash_attention_2' cannot run: {reason}")
    if reason not in _logged_fallbacks and not torch.compiler.is_compiling():
        _logged_fallbacks.add(reason)
        level = logging.WARNING if device.type == "cuda" else logging.INFO
        logger.log(level, "moonvit attention: %s; using sdpa", reason)
    return "sdpa"
