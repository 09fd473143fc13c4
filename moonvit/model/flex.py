"""FlexAttention over a whole pack: one compiled kernel, a block-sparse document mask.

The pack's L rows are attended to in one ``flex_attention`` call on a
(1, heads, L', head_dim) view, L' being L rounded up to the 128-row block. The
mask (row i sees row j only inside the same item) is handed over as a
:class:`~torch.nn.attention.flex_attention.BlockMask` built straight from the
item lengths: a 128 x 128 tile inside one item is *full* (no mask evaluated), a
tile straddling an item boundary is *partial* (the mask is evaluated per
element) and every other tile is skipped, so the work is that of the items'
diagonal blocks, never L^2. Padding rows form an item of their own and are
dropped from the output.

The kernel is compiled once per device, dtype and head shape with dynamic
sequence lengths (Inductor's C++ template on CPU, Triton on CUDA), so a new
pack size does not recompile. The compile takes seconds to tens of seconds, so it is announced on
the ``moonvit.flex`` logger before it starts (the command lines print it) and the first call's
time, compile included, is logged after it. CPU has no FlexAttention backward in torch: training on
CPU raises and names ``sdpa`` instead.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .grid import PackedGrid

logger = logging.getLogger("moonvit.flex")
"""Notices of the flex backend: the compile it is about to run, how long it took, a recompile."""

BLOCK = 128
"""Rows per tile of the block mask (FlexAttention's default block size)."""
FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MASK_CACHE_SIZE = 32

_lock = threading.Lock()
_masks: OrderedDict[tuple, Any] = OrderedDict()
_kernels: dict[tuple, Callable[..., torch.Tensor]] = {}
_first_calls: dict[tuple, float] = {}


@functools.cache
def flex_not_installed() -> str | None:
    """Why this torch has no usable FlexAttention, or None (looked up once: every forward asks)."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"it needs torch.nn.attention.flex_attention (torch >= 2.5), this is torch {torch.__version__}"
    return None


@functools.cache
def _toolchain(device_type: str) -> bool:
    """Whether the compiler flex needs on ``device_type`` is there: a C++ compiler on PATH for CPU,
    triton for CUDA (looked up once: every forward asks)."""
    if device_type == "cpu":
        return any(shutil.which(cc) for cc in ("c++", "g++", "clang++"))
    return importlib.util.find_spec("triton") is not None


def flex_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlexAttention cannot run on ``device`` in ``dtype``, or None."""
    if dtype not in FLEX_DTYPES:
        return f"flex attention runs in fp32, bf16 or fp16, the model is {dtype}"
    if device.type == "cpu" and not _toolchain("cpu"):
        return "flex attention on CPU compiles a C++ kernel and no C++ compiler (c++, g++, clang++) is on PATH"
    if device.type == "cuda" and not _toolchain("cuda"):
        return "flex attention on CUDA compiles a Triton kernel and triton is not installed"
    if device.type not in ("cpu", "cuda"):
        return f"flex attention runs on CPU and CUDA, the model is on {device.type}"
    return None


def padded_length(num_rows: int) -> int:
    """L rounded up to a whole number of mask tiles, and to at least two: with one tile the
    compiler specialises the mask's size-1 dimensions and builds a second kernel."""
    return max(-(-num_rows // BLOCK), 2) * BLOCK


def document_block_mask(seqlens: tuple[int, ...], device: torch.device) -> Any:
    """The BlockMask of a pack whose items have ``seqlens`` rows, padded to :func:`padded_length`.

    Returns a ``BlockMask`` over (L', L') whose mask_mod keeps (i, j) where rows
    i and j belong to the same item (padding rows are one more item). Cached per
    (seqlens, device).
    """
    key = (seqlens, str(device))
    with _lock:
        if key in _masks:
            _masks.move_to_end(key)
            return _masks[key]
    from torch.nn.attention.flex_attention import BlockMask

    total = sum(seqlens)
    padded = padded_length(total)
    lengths = torch.tensor([*seqlens, padded - total], device=device)
    item = torch.repeat_interleave(torch.arange(len(lengths), device=device, dtype=torch.int32), lengths)
    starts = torch.arange(0, padded, BLOCK, device=device)
    first, last = item[starts], item[starts + BLOCK - 1]
    # Tile (i, j) holds a pair of one item iff the item ranges of its rows and columns overlap;
    # it is full iff both ranges are the same single item.
    overlap = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    single = first == last
    full = overlap & single[:, None] & single[None, :] & (first[:, None] == first[None, :])

    def tiles(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (1, 1, Q tiles) counts and (1, 1, Q tiles, KV tiles) indices, the kept tiles first in order.
        count = keep.sum(dim=-1, dtype=torch.int32)
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[None, None], order[None, None]

    def same_item(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return item[q_idx] == item[kv_idx]

    mask = BlockMask.from_kv_blocks(
        *tiles(overlap & ~full), *tiles(full), BLOCK_SIZE=BLOCK, mask_mod=same_item, seq_lengths=(padded, padded)
    )
    with _lock:
        _masks[key] = mask
        while len(_masks) > _MASK_CACHE_SIZE:
            _masks.popitem(last=False)
    return mask


def _kernel(key: tuple, fresh: bool = False) -> Callable[..., torch.Tensor]:
    """The compiled FlexAttention for one kernel key (:func:`_kernel_key`), lengths dynamic.

    Each key gets a code object of its own, so that its compile is a first compile, never a
    recompile of another key's entry: recompiles of flex_attention with dynamic lengths do not
    build in torch 2.13's CPU template (a C++ error naming ``cur_qSplitSize``), first compiles do.
    ``fresh`` replaces the key's entry by a new one.
    """
    with _lock:
        kernel = None if fresh else _kernels.get(key)
        if kernel is None:
            from torch.nn.attention.flex_attention import flex_attention as flex

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
                return flex(q, k, v, block_mask=block_mask)

            name = f"flex_attention_{len(_kernels)}_{int(fresh)}"
            attend.__code__ = attend.__code__.replace(co_name=name)
            kernel = _kernels[key] = torch.compile(attend, dynamic=True, fullgraph=True)
    return kernel


@functools.cache
def _compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of a compile that did not build (torch's compiler errors; those this torch
    has), as opposed to errors of the inputs or of the run."""
    import torch._dynamo.exc as dynamo_errors
    import torch._inductor.exc as inductor_errors

    names = ((dynamo_errors, "BackendCompilerFailed"), (dynamo_errors, "RecompileError"),
             (dynamo_errors, "FailOnRecompileLimitHit"), (inductor_errors, "CppCompileError"))  # fmt: skip
    return tuple(error for module, name in names if isinstance(error := getattr(module, name, None), type))


def _kernel_key(q: torch.Tensor) -> tuple:
    """What a compiled kernel is specialised on: the inputs' device, dtype, heads and head_dim, and
    the global state the compiler guards (threads, grad and inference mode)."""
    return (
        str(q.device),
        q.dtype,
        q.shape[1],
        q.shape[3],
        torch.get_num_threads(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
    )


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
    """Block-diagonal attention of the pack in one compiled FlexAttention call.

    Args:
        q, k, v: (L, heads, head_dim).

    Returns:
        (L, heads, head_dim) in q's dtype.
    """
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        from .attention import AttentionUnavailableError

        raise AttentionUnavailableError(
            f"attn_implementation='flex' has no backward on CPU in torch {torch.__version__}; "
            "train with 'sdpa' (or run under torch.no_grad())"
        )
    total = q.shape[0]
    pad = padded_length(total) - total
    mask = document_block_mask(grid.seqlens, q.device)
    # One layout for every pack, (L', heads, head_dim) contiguous: rows sliced out of the fused qkv
    # projection have other strides, which would compile a second kernel (and, in torch 2.13's CPU
    # template with dynamic shapes, one that does not build).
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) if pad else t.contiguous() for t in (q, k, v))
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    key = _kernel_key(q)
    first = key not in _first_calls
    if first:
        logger.info("compiling the flex attention kernel for %s %s, %d heads x %d (once per shape; it can take "
                    "tens of seconds)", *key[:4])  # fmt: skip
    start = time.perf_counter()
    try:
        out = _kernel(key)(q, k, v, block_mask=mask)
    except _compile_errors() as error:
        if first:  # the first compile of this key failed: a fresh entry would compile the same
            raise
        # A guard the key does not cover made torch recompile this key's entry, which may not build
        # (see _kernel): compile it afresh, once; a second failure is raised.
        # torch wraps the compiler's own error, whose message runs to pages: name it, first line only.
        cause = getattr(error, "inner_exception", None) or error
        reason = next(iter(str(cause).strip().splitlines()), "")
        logger.info("flex attention: recompiling the kernel for %s %s, %d heads x %d failed (%s: %s); compiling "
                    "it afresh, once", *key[:4], type(cause).__name__, reason)  # fmt: skip
        out = _kernel(key, fresh=True)(q, k, v, block_mask=mask)
    if first:
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        _first_calls[key] = time.perf_counter() - start
        logger.info("flex attention: first call on %s %s (heads %d x %d), compile included: %.1f s",
                    *key[:4], _first_calls[key])  # fmt: skip
    return out.squeeze(0).transpose(0, 1)[:total]


def first_call_seconds() -> dict[tuple, float]:
    """Seconds of the first call per kernel key (device, dtype, heads, head_dim, threads, grad
    mode, inference mode), which include the compile."""
    return dict(_first_calls)
