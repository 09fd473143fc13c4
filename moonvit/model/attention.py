"""Attention over a pack of images, each image attending only to itself.

Six backends compute the same block-diagonal attention:

- ``flash_attention_2``: flash-attn's varlen kernel over the packed sequence
  (CUDA, bf16 / fp16; the optional ``moonvit[flash]`` extra).
- ``varlen``: the same packed call through torch's own FlashAttention,
  ``torch.nn.attention.varlen.varlen_attn`` (CUDA, bf16 / fp16, torch >= 2.10; no extra package,
  :mod:`moonvit.model.varlen`).
- ``openvino``: on a CPU with bf16 arithmetic, in bf16, items of 1,024 patches or more
  through OpenVINO's attention (1.5-1.9x torch's from 2,048 patches; the optional
  ``moonvit[openvino]`` extra, :mod:`moonvit.model.openvino_sdpa`), shorter ones
  through torch's, bit for bit as ``sdpa``. Inference only: a forward that autograd records
  or a tracer sees runs ``sdpa`` (:func:`attention_for_call`).
- ``sdpa``: torch's ``scaled_dot_product_attention``, one batched call per group
  of equally long images. No (L, L) mask is ever built, so memory grows with the
  total number of patches, not its square.
- ``flex``: torch's FlexAttention, one compiled kernel over the whole pack with a
  block-sparse document mask (:mod:`moonvit.model.flex`); opt-in, as it is
  slower than sdpa on the CPUs measured (see the README's speed section).
- ``eager``: plain math per image, the reference.

``auto`` picks, in registration order, the first backend that can run and that the host's
measurements do not pass over: on CUDA flash-attn where it is installed, then ``varlen``, then sdpa;
on a CPU OpenVINO's for a bf16 model where the host has AVX512-BF16 and no AMX
(:func:`~moonvit.model.openvino_sdpa.cpu_attention_choice`), otherwise sdpa. It logs once why it
passed the earlier ones over.

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
from .openvino_sdpa import (
    OPENVINO_MIN_PATCHES,
    openvino_auto_declined,
    openvino_not_installed,
    openvino_prescaled_rows,
    openvino_sdpa,
    openvino_unavailable,
)
from .tracing import is_traced, recorded_or_traced
from .varlen import packed_varlen_attention, varlen_head_dim_unsupported, varlen_not_installed, varlen_unavailable

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


GroupAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(q, k, v)`` on one group of equally long items: (items, seqlen, heads, head_dim) each, the
same shape back (any strides)."""


def by_groups(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid, attend: GroupAttention
) -> torch.Tensor:
    """Block-diagonal attention, one ``attend`` call per group of equally long items.

    Items of equal length form one (items, seqlen, heads, head_dim) batch, so 32 small images cost
    one call, not 32, and nothing is padded. Consecutive items are read as views of the packed
    rows; others are gathered (and their results scattered back).

    Args:
        q, k, v: (L, heads, head_dim) packed rows.

    Returns:
        (L, heads, head_dim).
    """
    groups = grid.attention_groups
    if len(groups) == 1 and groups[0].start is not None:
        return _group(q, k, v, groups[0], slice(None), attend)
    out = q.new_empty(q.shape)
    for group in groups:
        if group.start is not None:
            rows = slice(group.start, group.start + group.num_images * group.seqlen)
            out[rows] = _group(q, k, v, group, rows, attend)
        else:
            assert group.token_index is not None
            out[group.token_index.flatten()] = _group(q, k, v, group, group.token_index, attend)
    return out


def _group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: AttentionGroup,
    rows: slice | torch.Tensor,
    attend: GroupAttention,
) -> torch.Tensor:
    """Attention of one group; ``rows`` selects its packed rows. Returns (images * seqlen, heads, head_dim)."""
    if isinstance(rows, torch.Tensor):
        q, k, v = (t.index_select(0, rows.flatten()) for t in (q, k, v))
    else:
        q, k, v = (t[rows] for t in (q, k, v))
    q, k, v = (t.reshape(group.num_images, group.seqlen, *t.shape[1:]) for t in (q, k, v))
    return attend(q, k, v).flatten(0, 1)


def sdpa_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on one group, (items, seqlen, heads, head_dim) in and out."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
    """Block-diagonal attention with ``F.scaled_dot_product_attention``, one batched call per group of
    equally long items (:func:`by_groups`). No (L, L) mask is ever built."""
    return by_groups(q, k, v, grid, sdpa_group)


def openvino_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid, scale: float | None = None
) -> torch.Tensor:
    """Items of at least :data:`~moonvit.model.openvino_sdpa.OPENVINO_MIN_PATCHES` rows through OpenVINO's
    bf16 SDPA, the others (and every item under autograd or a tracer) through torch's, with ``scale``
    (default: head_dim ** -0.5) on the long items only: the encoder hands the long items' q already
    scaled (:func:`query_scale`) and binds ``scale=1.0``."""

    def attend(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor) -> torch.Tensor:
        long = qg.shape[1] >= OPENVINO_MIN_PATCHES  # the rows openvino_prescaled_rows names
        if long and not recorded_or_traced(qg, kg, vg):
            return openvino_sdpa(qg, kg, vg, scale)
        return sdpa_group(qg, kg, vg, scale if long else None)

    return by_groups(q, k, v, grid, attend)


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


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
    """torch's varlen FlashAttention on the packed (L, heads, head_dim) rows, one call per pack
    (:mod:`moonvit.model.varlen`); on a head_dim its kernel does not take, :func:`sdpa_attention`,
    with the reason logged once."""
    reason = varlen_head_dim_unsupported(q.shape[-1])
    if reason is not None:
        if not torch.compiler.is_compiling():
            _log_fallback(f"varlen: {reason}; using sdpa", logging.WARNING)
        return sdpa_attention(q, k, v, grid)
    return packed_varlen_attention(q, k, v, grid)


# ---- the registry ------------------------------------------------------------------------------


def _always(*_: object) -> None:
    return None


@dataclass(frozen=True)
class AttentionBackend:
    """One attention implementation.

    Attributes:
        name: what ``attn_implementation`` calls it.
        fn: ``fn(q, k, v, grid)`` on (L, heads, head_dim) rows, returning the same shape.
        unavailable: ``unavailable(device, dtype)``: why it cannot run there, or None.
        installed: whether its package is importable at all (checked when it is asked for by name).
        auto: whether ``auto`` may pick it; ``auto`` takes the first such backend, in
            registration order, that can run and that ``auto_declined`` does not pass over.
        auto_declined: ``auto_declined(device, dtype)``: why ``auto`` passes it over on this host
            though it can run (it was measured slower there than a later backend), or None. Asked
            for by name, it runs all the same.
        prescaled_rows: for a backend that would round ``q * head_dim ** -0.5`` to q's dtype itself
            (a second rounding of q: OpenVINO's), ``prescaled_rows(grid)``, (L,) bool, the rows
            whose q it takes already scaled (None: none in this pack). The encoder then scales them
            in their RoPE rotation, rounded once (:func:`query_scale`), and binds ``fn`` with
            ``scale=1.0`` (the scale of those rows; the others keep the default).
        inference_only: whether it runs in eager inference only (no backward, nothing a tracer can
            follow: OpenVINO's). A forward that autograd records or a tracer sees runs ``sdpa`` in its
            place (:func:`attention_for_call`).
    """

    name: str
    fn: AttentionFn
    unavailable: Callable[[torch.device, torch.dtype], str | None]
    installed: Callable[[], str | None]
    auto: bool
    prescaled_rows: Callable[[PackedGrid], torch.Tensor | None] | None = None
    inference_only: bool = False
    auto_declined: Callable[[torch.device, torch.dtype], str | None] = _always


_BACKENDS: dict[str, AttentionBackend] = {}


def register_attention(
    name: str,
    fn: AttentionFn,
    *,
    unavailable: Callable[[torch.device, torch.dtype], str | None] = _always,
    installed: Callable[[], str | None] = _always,
    auto: bool = False,
    prescaled_rows: Callable[[PackedGrid], torch.Tensor | None] | None = None,
    inference_only: bool = False,
    auto_declined: Callable[[torch.device, torch.dtype], str | None] = _always,
) -> None:
    """Add (or replace) an attention backend; see :class:`AttentionBackend`."""
    if name == "auto":
        raise ValueError("'auto' is reserved for the automatic choice")
    _BACKENDS[name] = AttentionBackend(
        name, fn, unavailable, installed, auto, prescaled_rows, inference_only, auto_declined
    )


def attention_names() -> tuple[str, ...]:
    """Every accepted ``attn_implementation``: ``auto`` and the registered backends."""
    return ("auto", *_BACKENDS)


def get_attention(name: str) -> AttentionFn:
    """The function of a registered backend (not ``auto``: resolve it first)."""
    return _BACKENDS[name].fn


def bind_attention(name: str, grid: PackedGrid, *, prescaled: bool = False) -> BoundAttention:
    """The registered backend ``name`` (not ``auto``: resolve it first) bound to ``grid``'s pack;
    ``prescaled``: the rows :func:`query_scale` scales arrive with q already scaled."""
    fn = _BACKENDS[name].fn
    if prescaled:
        if _BACKENDS[name].prescaled_rows is None:
            raise ValueError(f"attention backend {name!r} takes no prescaled q")
        takes_scale: Callable[..., torch.Tensor] = fn  # such a backend's fn takes ``scale`` too

        def attend_scaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return takes_scale(q, k, v, grid, scale=1.0)

        return attend_scaled

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fn(q, k, v, grid)

    return attend


def attention_for_call(name: str, *tensors: torch.Tensor) -> str:
    """The backend a forward runs: ``name`` (resolved), or ``sdpa`` in place of an inference-only one
    where autograd records an op on ``tensors`` (the forward's input and parameters) or a tracer sees
    the call.

    Such a backend would hand every item to torch's SDPA there anyway, but on q prepared for itself
    (:func:`query_scale`); as ``sdpa``, a training forward has sdpa's bits whether or not the
    backend's package is installed.
    """
    if _BACKENDS[name].inference_only and recorded_or_traced(*tensors):
        return "sdpa"
    return name


def query_scale(name: str, grid: PackedGrid, head_dim: int) -> torch.Tensor | None:
    """(L,) float32 factor of each row's q before its rounding: ``head_dim ** -0.5`` on the rows backend
    ``name`` takes prescaled, 1.0 elsewhere (exact: those rows keep their bits); None where it takes
    none in this pack (every backend but OpenVINO's). Bind with ``prescaled=True`` when it is not None."""
    rows_of = _BACKENDS[name].prescaled_rows
    rows = None if rows_of is None else rows_of(grid)
    if rows is None:
        return None
    one = torch.ones((), dtype=torch.float32, device=rows.device)
    return torch.where(rows, one * head_dim**-0.5, one)


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
    cannot run). ``auto`` takes the first auto-eligible backend that can run and that the host's
    measurements do not pass over (``auto_declined``), and logs once why it passed the earlier ones
    over. Under a tracer an inference-only backend is not asked about the host (a tracer cannot
    follow those questions, and :func:`attention_for_call` runs ``sdpa`` in its place there).

    Raises:
        AttentionUnavailableError: a named backend cannot run on this device or dtype.
    """
    if requested != "auto":
        backend = _BACKENDS[requested]
        if backend.inference_only and is_traced():
            return requested
        reason = backend.installed() or backend.unavailable(device, dtype)
        if reason is not None:
            raise AttentionUnavailableError(f"attn_implementation={requested!r} cannot run: {reason}")
        return requested
    skipped: list[str] = []
    for backend in _BACKENDS.values():
        if not backend.auto or (backend.inference_only and is_traced()):
            continue
        reason = backend.installed() or backend.unavailable(device, dtype) or backend.auto_declined(device, dtype)
        if reason is None:
            if skipped and not torch.compiler.is_compiling():
                # on CUDA sdpa is the slow path (one call per group of equal lengths): a warning
                slow = device.type == "cuda" and backend.name == "sdpa"
                _log_fallback(f"{'; '.join(skipped)}; using {backend.name}", logging.WARNING if slow else logging.INFO)
            return backend.name
        skipped.append(f"{backend.name}: {reason}")
    raise AttentionUnavailableError(f"no attention backend can run on {device} in {dtype}: {'; '.join(skipped)}")


def _log_fallback(message: str, level: int) -> None:
    """Log ``message`` on the ``moonvit`` logger, once per process."""
    if message in _logged_fallbacks:
        return
    _logged_fallbacks.add(message)
    logger.log(level, "moonvit attention: %s", message)


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
register_attention(
    "varlen", varlen_attention, unavailable=varlen_unavailable, installed=varlen_not_installed, auto=True
)
register_attention(
    "openvino",
    openvino_attention,
    unavailable=openvino_unavailable,
    installed=openvino_not_installed,
    auto=True,
    prescaled_rows=openvino_prescaled_rows,
    inference_only=True,
    auto_declined=openvino_auto_declined,
)
register_attention("sdpa", sdpa_attention, auto=True)
register_attention("flex", flex_attention, unavailable=flex_unavailable, installed=flex_not_installed)
register_attention("eager", eager_attention)
