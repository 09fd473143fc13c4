"""OpenVINO's CPU attention in bf16, for the long items of a pack.

On a CPU with bf16 arithmetic, OpenVINO's ScaledDotProductAttention in bf16 beats torch's CPU flash
kernel on long items (16 heads of 72, 2 threads, AMD Zen 4: 1.8x at 1,024 patches called on its own,
1.5-1.8x at 2,048 and 4,096; ``benchmarks/bench_attention_cpu.py`` at 4,096 and 25,600). The backend
``openvino`` (:mod:`moonvit.model.attention`) sends items of at least :data:`OPENVINO_MIN_PATCHES` rows
here and the others to torch's SDPA. q, k and v go in as one buffer, the block's wqkv output itself,
split inside OpenVINO's graph: no copies on the way in.

Where ``auto`` takes it. Not on every CPU with bf16 arithmetic: on an Intel CPU with AMX the tower
ran 0.80-0.85x as fast with it as with torch's SDPA (torch's attention itself faster there, and the
matmuls slower beside OpenVINO's threads).
:func:`cpu_attention_choice` is the rule, a pure function of the host's facts (:class:`CpuHost`):
OpenVINO's attention for bf16 items of :data:`OPENVINO_MIN_PATCHES` or more on a CPU with
AVX512-BF16 and no AMX, torch's SDPA elsewhere; asked for by name, it runs on any CPU with bf16
arithmetic.

Threads. OpenVINO runs its own threads beside torch's. After each parallel op torch's OpenMP threads
spin for a few milliseconds before they sleep (libgomp's default), and OpenVINO's threads share the
cores with them meanwhile: called right after a torch matmul, a 1,024-patch item's
attention took 26-28 ms against 18 ms called on its own. Shorter items gain nothing inside a forward
(one item of 256 patches: 0.77x the forward's speed with sdpa), hence the threshold. A process started
with ``GOMP_SPINCOUNT=10000`` (libgomp, the OpenMP of torch's pip wheels: its threads sleep sooner)
gets most of it back.

Accuracy. OpenVINO multiplies the bf16 q by the scale and rounds the product to bf16: a second
rounding of q, which leaves its result about 1.3x further from float64 than torch's (whose scale
goes on the float32 scores). Given q already scaled and ``scale=1.0`` (exact), it rounds nothing
twice and its error is within a few percent of torch's. So the encoder multiplies the long items'
q by ``head_dim ** -0.5`` inside their RoPE rotation, in float32 before the one rounding to bf16
(:func:`~moonvit.model.attention.query_scale`); called without it, :func:`openvino_sdpa` scales q
itself, as OpenVINO would.

Fork. OpenVINO's thread pool does not survive ``fork``: in a child forked from a process where
OpenVINO had compiled, its next compile or inference waits forever (one thread or several). Such a
child takes torch's SDPA for every item under ``auto``, and an explicit ``openvino`` is refused
with the reason, rather than hang; nor does the child hang at its exit on the parent's compiled
models, which it never frees. Workers started with ``spawn`` or ``forkserver`` (Ray's among them)
run OpenVINO as usual.

OpenVINO is optional (``pip install 'moonvit[openvino]'``), imported on first use; one model is
compiled per torch thread count (in milliseconds, dynamic shapes) and runs with that many threads.
Tensors go in and out without copies (bf16 buffers shared with OpenVINO). There is no backward:
under autograd, ``torch.compile`` or ONNX export every item takes torch's SDPA, and the encoder runs
the ``sdpa`` backend in its place, q not prescaled (:func:`~moonvit.model.attention.attention_for_call`):
sdpa's bits.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .linear import cpu_has_bf16_arithmetic, cpu_units

if TYPE_CHECKING:
    from .grid import PackedGrid

OPENVINO_MIN_PATCHES = 1024
"""Items of at least this many rows go through OpenVINO: in a forward (2 threads, Zen 4) the tower was
1.035x faster than with sdpa at 1,024 patches, 0.77x at 256 (see the module's note on threads)."""

_lock = threading.Lock()
_compiled: dict[int, Any] = {}
_started = False
"""Whether this process has compiled an OpenVINO model (and so started OpenVINO's threads)."""
_forked_after_start = False
"""Whether this process was forked from one where :data:`_started` held: OpenVINO hangs here."""

FORKED = (
    "this process was forked after OpenVINO had started in its parent, and OpenVINO's threads do not "
    "survive a fork (it would wait forever); start workers with the 'spawn' or 'forkserver' method to use it"
)


def _after_fork_in_child() -> None:
    """In a forked child: OpenVINO is off if its threads had started, and the parent's compiled models
    are never freed (their destructors wait on those threads too: the child would hang at its exit)."""
    global _lock, _forked_after_start
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _forked_after_start = _started
    for model in _compiled.values():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(model))


os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.cache
def openvino_not_installed() -> str | None:
    """Why the openvino backend cannot be imported, or None."""
    if importlib.util.find_spec("openvino") is None:
        return "it needs OpenVINO, which is not installed (pip install 'moonvit[openvino]')"
    return None


def openvino_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the openvino backend does not run for a model on ``device`` in ``dtype``, or None."""
    if device.type != "cpu":
        return f"OpenVINO's attention runs on CPU, the model is on {device.type}"
    if dtype != torch.bfloat16:
        return f"OpenVINO's attention is used in bf16 (in float32 it is slower than sdpa), the model is {dtype}"
    if not cpu_has_bf16_arithmetic():
        return "this CPU has no bf16 arithmetic (AVX512-BF16 or AMX): OpenVINO's bf16 attention is slower here"
    if _forked_after_start:
        return FORKED
    return None


# ---- auto's choice on a CPU ---------------------------------------------------------------------


@dataclass(frozen=True)
class CpuHost:
    """What ``auto``'s choice between OpenVINO's attention and torch's rests on: facts the host reports.

    Attributes:
        amx: AMX tiles (Intel Sapphire Rapids and later).
        avx512_bf16: AVX512-BF16 dot products (AMD Zen 4 and later, Intel Cooper Lake and later).
        threads: torch's intra-op threads (OpenVINO runs as many of its own).
        torch_version: ``torch.__version__``.
        openvino: whether OpenVINO is installed.
    """

    amx: bool
    avx512_bf16: bool
    threads: int
    torch_version: str
    openvino: bool


def cpu_host() -> CpuHost:
    """This process's :class:`CpuHost` (threads as set now; eager only: a tracer cannot ask)."""
    amx, avx512_bf16 = cpu_units()
    return CpuHost(amx, avx512_bf16, torch.get_num_threads(), torch.__version__, openvino_not_installed() is None)


def openvino_declined(host: CpuHost, dtype: torch.dtype, seqlen: int = OPENVINO_MIN_PATCHES) -> str | None:
    """Why ``auto`` leaves an item of ``seqlen`` rows in ``dtype`` to torch's SDPA on ``host``, or None
    where OpenVINO's attention runs it. Each rule rests on a measurement (``benchmarks/results/
    cpu_attention_choice.md``, 2 threads, torch 2.13, OpenVINO 2026.4):

    - AMX (Intel, 448x448 and 896x896, 27 blocks): the tower ran 0.85x and 0.80x as fast with
      OpenVINO's attention as with sdpa; per block, torch's attention took 13.4 and 28.9 ms per 1,000
      patches against OpenVINO's 21.1 and 81.5, and the matmuls beside OpenVINO's threads 52.7
      against 26.6 at 896x896;
    - AVX512-BF16 without AMX (AMD Zen 4): 1.09x and 1.47x, OpenVINO's bf16 attention using the dot
      products torch's CPU attention does not (it takes the same time in bf16 and float32 there);
    - neither (no bf16 arithmetic, or not x86: unmeasured): torch's;
    - items under :data:`OPENVINO_MIN_PATCHES`: torch's (0.77x at 256 patches on Zen 4).

    Thread count and torch version are not part of the rule: both classes were measured at 2 threads
    on torch 2.13, and other settings take the same choice, unmeasured.
    """
    if not host.openvino:
        return "OpenVINO is not installed (pip install 'moonvit[openvino]')"
    if dtype != torch.bfloat16:
        return f"OpenVINO's attention is used in bf16 only, the model is {dtype}"
    if host.amx:
        return "this CPU has AMX, where torch's SDPA is faster than OpenVINO's attention (measured: 0.80-0.85x)"
    if not host.avx512_bf16:
        return "this CPU has no AVX512-BF16, where OpenVINO's bf16 attention is not measured to win"
    if seqlen < OPENVINO_MIN_PATCHES:
        return f"items under {OPENVINO_MIN_PATCHES} patches are faster through torch's SDPA"
    return None


def cpu_attention_choice(host: CpuHost, dtype: torch.dtype, seqlen: int) -> str:
    """The backend ``auto`` runs an item of ``seqlen`` rows in ``dtype`` with on a CPU ``host``:
    ``openvino`` or ``sdpa`` (:func:`openvino_declined` says why)."""
    return "sdpa" if openvino_declined(host, dtype, seqlen) else "openvino"


def openvino_auto_declined(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``auto`` passes the ``openvino`` backend over on this host, though it could run, or None:
    :func:`openvino_declined` for its long items (the backend hands the others to torch's SDPA)."""
    return openvino_declined(cpu_host(), dtype) if device.type == "cpu" else None


def openvino_prescaled_rows(grid: PackedGrid) -> torch.Tensor | None:
    """(L,) bool: the rows of items of at least :data:`OPENVINO_MIN_PATCHES`, whose q the backend takes
    already scaled; None where the pack has no such item."""
    long_items = torch.tensor(grid.seqlens) >= OPENVINO_MIN_PATCHES
    if not bool(long_items.any()):
        return None
    return long_items.to(grid.item_index.device).index_select(0, grid.item_index)


def openvino_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v by OpenVINO, in bf16 on CPU.

    Args:
        q, k, v: (items, seqlen, heads, head_dim) bf16, any strides.
        scale: None for ``head_dim ** -0.5``; 1.0 for a q already scaled (as the encoder hands it).

    Returns:
        (items, seqlen, heads, head_dim) bf16, contiguous.
    """
    if q.dtype != torch.bfloat16 or q.device.type != "cpu":
        raise ValueError(f"OpenVINO's attention takes bf16 CPU tensors, got {q.dtype} on {q.device.type}")
    if _forked_after_start:
        raise RuntimeError(f"OpenVINO's attention cannot run: {FORKED}")
    if scale != 1.0:
        factor = q.shape[-1] ** -0.5 if scale is None else scale
        q = (q.float() * factor).to(q.dtype)
    qkv = _stacked(q, k, v)  # held here: OpenVINO's tensors over qkv and out do not keep them alive
    out = torch.empty(q.shape, dtype=q.dtype)
    request = _compiled_attention(torch.get_num_threads()).create_infer_request()
    request.set_input_tensor(0, _shared(qkv))
    request.set_output_tensor(0, _shared(out))
    try:
        request.infer()
    except RuntimeError as error:
        raise RuntimeError(f"OpenVINO's attention failed on q, k, v of {tuple(q.shape)}: {error}") from error
    return out


def _stacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v as one contiguous (items, seqlen, 3, heads, head_dim) tensor: a view where they are the
    three thirds of one such buffer (a block's wqkv output, as the encoder hands them), a stacked copy
    otherwise."""
    shape = (*q.shape[:2], 3, *q.shape[2:])
    fits = (q.storage_offset() + math.prod(shape)) * q.element_size() <= q.untyped_storage().nbytes()
    if q.shape == k.shape == v.shape and fits:
        whole = q.as_strided(shape, [math.prod(shape[i + 1 :]) for i in range(len(shape))])
        # the same addresses and strides: k and v are in q's buffer, where whole's thirds are
        if all(_same_view(whole[:, :, i], t) for i, t in enumerate((q, k, v))):
            return whole
    return torch.stack([q, k, v], dim=2)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def _shared(tensor: torch.Tensor) -> Any:
    """An OpenVINO bf16 tensor over ``tensor``'s own (contiguous) memory."""
    import openvino as ov

    return ov.Tensor(tensor.view(torch.int16).numpy(), list(tensor.shape), ov.Type.bf16)


def _compiled_attention(threads: int) -> Any:
    """The compiled (items, seqlen, heads, head_dim) bf16 attention with scale 1, for ``threads`` threads."""
    global _started
    with _lock:
        compiled = _compiled.get(threads)
        if compiled is None:
            _started = True  # before the compile: its threads are started by it
            compiled = _compiled[threads] = _compile(threads)
        return compiled


def _compile(threads: int) -> Any:
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    # bf16 in and out, shared with torch; the attention itself is declared in float32 and computed
    # in bf16 by the precision hint: declared in bf16 it takes a path 3x further from float64.
    # Its SDPA takes (..., seqlen, head_dim): heads go before the rows and back inside the graph.
    qkv = ops.parameter([-1, -1, 3, -1, -1], ov.Type.bf16, name="qkv")
    thirds = ops.split(ops.convert(qkv, "f32"), ops.constant(np.int64(2)), 3).outputs()
    axis, order = (ops.constant(np.array(value, dtype=np.int64)) for value in ([2], [0, 2, 1, 3]))
    q, k, v = (ops.transpose(ops.squeeze(third, axis), order) for third in thirds)
    one = ops.constant(np.array(1.0, dtype=np.float32))
    out = ops.transpose(ops.scaled_dot_product_attention(q, k, v, scale=one, causal=False), order)
    out = ops.convert(out, "bf16")
    config = {
        "INFERENCE_PRECISION_HINT": "bf16",
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
        "ENABLE_CPU_PINNING": False,  # a guest in the caller's process: torch's threads stay movable
    }
    return ov.Core().compile_model(ov.Model([out], [qkv], "moonvit_attention"), "CPU", config)
