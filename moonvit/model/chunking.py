"""Row-wise work on CPU, run over chunks of rows.

glibc returns every freed buffer above its mmap threshold (32 MiB at most) to
the OS, so a large temporary costs fresh pages, one fault per 4 KiB, on every
call: as much as the arithmetic around it. Row-wise work on CPU therefore runs
over chunks of rows whose temporaries stay under a byte budget, which the
allocator recycles. CUDA's caching allocator has no such cliff; there one large
call is best.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .tracing import is_traced


def map_row_chunks(
    fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, row_bytes: int, budget: int
) -> torch.Tensor:
    """``fn(*tensors)`` for a ``fn`` independent across rows (dim 0).

    On CPU, computed over chunks of rows, so that a chunk's temporaries of
    ``row_bytes`` per row take at most ``budget`` bytes; the results are
    concatenated. Elsewhere, and under ``torch.compile`` or ONNX export (whose graphs take any
    number of rows: no data-dependent split there), one call.
    """
    rows = max(1, budget // max(1, row_bytes))
    if is_traced() or tensors[0].device.type != "cpu" or len(tensors[0]) <= rows:
        return fn(*tensors)
    return torch.cat([fn(*chunks) for chunks in zip(*(t.split(rows) for t in tensors))])
