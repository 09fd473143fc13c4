"""Attention over a pack of images, each image attending only to itself.

Four backends compute the same block-diagonal attention:

- ``flash_attention_2``: flash-attn's varlen kernel over the packed sequence
  (CUDA, bf16 / fp16; the optional ``moonvit[flash]`` extra).
- ``sdpa``: torch's ``scaled_dot_product_attention``, one batched call per group
  of equally long images. No (L, L) mask is ever built, so memory grows with the
  total number of patches, not its square.
- ``flex``: torch's FlexAttention, one compiled kernel over the whole pack with a
  block-sparse document mask (:mod:`moonvit.model.flex`); opt-in, as it is
  slower than sdpa on the CPUs measured (see the README's speed section).
- ``eager``: plain math per image, the reference.

``auto`` picks flash-attn where it can run and otherwise falls back to sdpa.

The backends live in one registry (:func:`register_attention`): the names that
configs, ``set_attn_implementation`` and the CLIs accept all come from it, so a
new backend (a CPU kernel, another GPU library) is one function and one
``register_attention`` call.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .flex import flex_attention, flex_not_installed, flex_unavailable

if TYPE_CHECKING:
    from .grid import AttentionGroup, PackedGrid

logger = logging.getLogger("moonvit")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "PackedGrid"], torch.Tensor]
BoundAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(q, k, v)``: a backend bound to one pack (:func:`bind_attention`), what a block calls."""
FLASH_DTYPES = (torch.bfloat16, torch.float16)
_FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None
_logged_fallbacks: set[str] = set()


class AttentionUnavailableError(RuntimeError):
    """An attention backend asked for by name cannot run: its package is missing, or the device or
    dtype does not suit it (the message says which)."""


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
            assert group.token_index is not None
            out[group.token_index.flatten()] = _sdpa_group(q, k, v, group, group.token_index)
    return out


def _sdpa_group(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup, rows: slice | torch.Tensor
) -> torch.Tensor:
    """Attention of one group; ``rows`` selects its packed rows. Returns (images * seqlen, heads, head_dim)."""
    if isinstance(rows, torch.Tensor):
        q, k, v = (t.index_select(0, rows.flatten()) for t in (q, k, v))
    else:
        q, k, v = (t[rows] for t in (q, k, v))
    q, k, v = (t.reshape(group.num_images, group.seqlen, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(0, 1)


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


# ---- the registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionBackend:
    """One attention implementation.

    Attributes:
        name: what ``attn_implementation`` calls it.
        fn: ``fn(q, k, v, grid)`` on (L, heads, head_dim) rows, returning the same shape.
        unavailable: ``unavailable(device, dtype)``: why it cannot run there, or None.
        installed: whether its package is importable at all (checked when it is asked for by name).
        auto: whether ``auto`` may pick it; ``auto`` takes the first such backend, in
            registration order, that can run.
    """

    name: str
    fn: AttentionFn
    unavailable: Callable[[torch.device, torch.dtype], str | None]
    installed: Callable[[], str | None]
    auto: bool


_BACKENDS: dict[str, AttentionBackend] = {}


def _always(*_: object) -> None:
    return None


def register_attention(
    name: str,
    fn: AttentionFn,
    *,
    unavailable: Callable[[torch.device, torch.dtype], str | None] = _always,
    installed: Callable[[], str | None] = _always,
    auto: bool = False,
) -> None:
    """Add (or replace) an attention backend; see :class:`AttentionBackend`."""
    if name == "auto":
        raise ValueError("'auto' is reserved for the automatic choice")
    _BACKENDS[name] = AttentionBackend(name, fn, unavailable, installed, auto)


def attention_names() -> tuple[str, ...]:
    """Every accepted ``attn_implementation``: ``auto`` and the registered backends."""
    return ("auto", *_BACKENDS)


def get_attention(name: str) -> AttentionFn:
    """The function of a registered backend (not ``auto``: resolve it first)."""
    return _BACKENDS[name].fn


def bind_attention(name: str, grid: PackedGrid) -> BoundAttention:
    """The registered backend ``name`` (not ``auto``: resolve it first) bound to ``grid``'s pack."""
    fn = _BACKENDS[name].fn

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fn(q, k, v, grid)

    return attend


def check_attn_name(name: str) -> None:
    """Raise ValueError for a name that is neither ``auto`` nor a registered backend."""
    if name not in attention_names():
        raise ValueError(f"attn_implementation must be one of {attention_names()}, got {name!r}")


def check_attn_implementation(name: str) -> None:
    """Raise early for a backend that is unknown or whose package is not installed."""
    check_attn_name(name)
    reason = None if name == "auto" else _BACKENDS[name].installed()
    if reason is not None:
        raise AttentionUnavailableError(f"attn_implementation={name!r} cannot be used: {reason}")


def resolve_attn_implementation(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to run for a model on ``device`` in ``dtype``.

    A named backend is used as asked (RuntimeError, with the reason, where it
    cannot run). ``auto`` takes the first auto-eligible backend that can run and
    logs, once per reason, why an earlier one could not.

    Raises:
        AttentionUnavailableError: a named backend cannot run on this device or dtype.
    """
    if requested != "auto":
        backend = _BACKENDS[requested]
        reason = backend.installed() or backend.unavailable(device, dtype)
        if reason is not None:
            raise AttentionUnavailableError(f"attn_implementation={requested!r} cannot run: {reason}")
        return requested
    skipped: list[str] = []
    for backend in _BACKENDS.values():
        if not backend.auto:
            continue
        reason = backend.installed() or backend.unavailable(device, dtype)
        if reason is None:
            if skipped and not torch.compiler.is_compiling():
                _log_fallback(skipped[0], backend.name, device)
            return backend.name
        skipped.append(reason)
    raise AttentionUnavailableError(f"no attention backend can run on {device} in {dtype}: {'; '.join(skipped)}")


def _log_fallback(reason: str, chosen: str, device: torch.device) -> None:
    if reason in _logged_fallbacks:
        return
    _logged_fallbacks.add(reason)
    level = logging.WARNING if device.type == "cuda" else logging.INFO
    logger.log(level, "moonvit attention: %s; using %s", reason, chosen)


def _flash_not_installed() -> str | None:
    return (
        None if flash_attn_installed() else "it needs flash-attn, which is not installed (pip install 'moonvit[flash]')"
    )


def _flash_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, the model is on {device.type}"
    if dtype not in FLASH_DTYPES:
        return f"flash-attn needs bf16 or fp16, the model is {dtype}"
    return None


register_attention(
    "flash_attention_2", flash_attention, unavailable=_flash_unavailable, installed=_flash_not_installed, auto=True
)
register_attention("sdpa", sdpa_attention, auto=True)
register_attention("flex", flex_attention, unavailable=flex_unavailable, installed=flex_not_installed)
register_attention("eager", eager_attention)
