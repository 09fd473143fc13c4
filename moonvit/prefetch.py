"""Overlap preparing the next units of work (decoding a pack, rendering a batch) with using this one.

:func:`prefetch` maps a function over an iterable in background threads, a bounded number of items
ahead, and yields the results in input order. Decoding and resizing (Pillow, PyAV) and torch's
CPU kernels release the GIL, so threads overlap them with the encoder's forward; the results are
those of the serial loop, bit for bit, since each item is prepared by the same call either way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def prefetch(items: Iterable[T], fn: Callable[[T], R], workers: int = 0) -> Iterator[tuple[T, R]]:
    """``(item, fn(item))`` for each item, in order.

    Args:
        items: consumed lazily, at most ``workers`` items ahead of the one yielded.
        fn: the preparation of one item; an exception it raises is raised here, at that item.
        workers: background threads; 0 runs ``fn`` inline, item by item (the serial loop).

    Raises:
        ValueError: ``workers`` is negative.
    """
    if workers < 0:
        raise ValueError(f"workers must be 0 (inline) or more, got {workers}")
    if workers == 0:
        for item in items:
            yield item, fn(item)
        return
    source = iter(items)
    pending: deque[tuple[T, Future[R]]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moonvit-prefetch") as pool:
        try:
            for item in source:
                pending.append((item, pool.submit(fn, item)))
                if len(pending) > workers:
                    head, future = pending.popleft()
                    yield head, future.result()
            while pending:
                head, future = pending.popleft()
                yield head, future.result()
        finally:  # the consumer stopped early or an item failed: drop what was not started
            for _, future in pending:
                future.cancel()
