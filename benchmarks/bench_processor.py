"""Benchmark MoonViTImageProcessor throughput and encode_images' memory under a patch budget.

1. Processor: images/s over a mixed list of synthetic images (thumbnails to 12 MP, PIL RGB / RGBA,
   numpy, uint8 and float tensors, JPEG files in a temporary folder), one call per image as a
   data loader makes them, with the time per image size.
2. encode_images: peak live heap above the starting point while encoding a long, lazily
   generated list of small images with a randomly initialised encoder under ``--max-patches``.
   "Live heap" is glibc's count of bytes currently allocated by malloc (``mallinfo2()``:
   ``uordblks + hblkhd``), sampled every millisecond: it covers tensors, numpy and Pillow buffers
   and large Python objects in every thread, and, unlike RSS, does not count memory that was
   freed but kept by the allocator. Small Python objects (pymalloc arenas) are not counted and
   spikes shorter than a sample can be missed. The iterator form drops each result, so its peak
   is the working set; it is measured at two list lengths to show it does not grow with the list.
   The list form keeps every result, whose own size is printed next to it. Linux (glibc) only.

Example: python benchmarks/bench_processor.py --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from moonvit import PRESETS, MoonViT, MoonViTImageProcessor, encode_images, iter_encode_images, pack_images
from moonvit.cli import add_budget_argument, add_threads_argument, apply_threads, positive_int
from moonvit.media.image import ImageInput

# (width, height): thumbnails to a 12 MP photo (resized to the budget) and a long strip
SIZES = [(64, 48), (224, 224), (640, 480), (1280, 720), (1920, 1080), (4000, 3000), (6000, 300)]
KINDS = ["pil_rgb", "pil_rgba", "numpy", "tensor_uint8", "tensor_float", "jpeg_file"]


def synthetic_image(width: int, height: int, kind: str, rng: np.random.Generator, folder: Path) -> ImageInput:
    """A photo-like random image (a colour gradient plus noise) of the given input kind."""
    x = np.linspace(0, 200, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 50, height, dtype=np.float32)[:, None]
    gradient = (x + y).astype(np.uint8)
    noise = rng.integers(0, 6, (height, width, 3), dtype=np.uint8)
    array = np.dstack([gradient, gradient[::-1], gradient[:, ::-1]]) + noise  # at most 250 + 5
    if kind == "pil_rgb":
        return Image.fromarray(array)
    if kind == "pil_rgba":
        return Image.fromarray(np.dstack([array, np.full((height, width), 200, np.uint8)]))
    if kind == "numpy":
        return array
    if kind == "tensor_uint8":
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()
    if kind == "tensor_float":
        return torch.from_numpy(array).permute(2, 0, 1).float().div(255)
    path = folder / f"{width}x{height}_{rng.integers(1 << 30)}.jpg"
    Image.fromarray(array).save(path, quality=90)
    return path


def bench_processor(processor: MoonViTImageProcessor, count: int, folder: Path) -> None:
    rng = np.random.default_rng(0)
    sizes = [SIZES[i % len(SIZES)] for i in range(count)]
    kinds = [KINDS[(i // len(SIZES)) % len(KINDS)] for i in range(count)]  # every size in every kind
    images = [synthetic_image(*size, kind, rng, folder) for size, kind in zip(sizes, kinds)]
    processor(images[: len(SIZES)])  # warm-up
    seconds = dict.fromkeys(SIZES, 0.0)
    patches = 0
    for size, image in zip(sizes, images):
        start = time.perf_counter()
        patches += processor(image).pixel_values.shape[0]
        seconds[size] += time.perf_counter() - start
    elapsed = sum(seconds.values())
    print(
        f"processor: {count} mixed images in {elapsed:.2f} s: {count / elapsed:.1f} images/s, "
        f"{patches / elapsed / 1e3:.1f} k patches/s (kinds: {', '.join(KINDS)})"
    )
    for size, total in seconds.items():
        grid = processor.plan_image(*size).grid_hw
        per_image = total / sizes.count(size)
        print(f"  {size[0]:5d} x {size[1]:<5d} -> grid {grid[0]:3d} x {grid[1]:<3d} {per_image * 1e3:7.2f} ms/image")


def small_images(count: int, seed: int) -> Iterator[np.ndarray]:
    """``count`` random uint8 images of 20-224 px per side, generated one at a time."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        width, height = rng.integers(20, 225, size=2)
        yield rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


_MALLINFO2_FIELDS = [
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
]


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t counters
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2]:
    function = ctypes.CDLL("libc.so.6").mallinfo2
    function.restype = _MallInfo2
    return function


def heap_in_use() -> int:
    """Bytes currently allocated through malloc, in all arenas and mmapped chunks."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


def peak_heap_growth(run: Callable[[], object]) -> tuple[object, int, float]:
    """Run ``run()``; return its result, the peak live heap above the start, and seconds taken."""
    baseline, peak, done = heap_in_use(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], heap_in_use())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    try:
        result = run()
    finally:
        elapsed = time.perf_counter() - start
        done.set()
        sampler.join()
    return result, max(peak[0], heap_in_use()) - baseline, elapsed


def bench_encode(processor: MoonViTImageProcessor, preset: str, count: int, budget: int) -> None:
    encoder = MoonViT.from_preset(preset).eval()
    encode_images(encoder, processor, small_images(8, seed=1), max_patches_per_pack=budget)  # warm-up
    packs = list(pack_images(small_images(count, seed=0), processor, budget))
    patches = sum(pack.num_patches for pack in packs)
    print(
        f"encode_images: {count} images of 20-224 px, {patches} patches in {len(packs)} packs of "
        f"<= {budget} patches, preset {preset!r} (hidden {encoder.config.hidden_size})"
    )

    def drain(n: int) -> int:
        return sum(
            1 for _ in iter_encode_images(encoder, processor, small_images(n, seed=0), max_patches_per_pack=budget)
        )

    for n in (count // 4, count):
        _, growth, elapsed = peak_heap_growth(lambda: drain(n))
        print(
            f"  iter_encode_images, {n:5d} images, results dropped: peak live heap +{growth / 2**20:6.1f} MiB, "
            f"{elapsed:5.2f} s, {n / elapsed:.0f} images/s"
        )
    tokens, growth, elapsed = peak_heap_growth(
        lambda: encode_images(encoder, processor, small_images(count, seed=0), max_patches_per_pack=budget)
    )
    held = sum(t.numel() * t.element_size() for t in tokens)
    print(
        f"  encode_images,      {count:5d} images, results kept:    peak live heap +{growth / 2**20:6.1f} MiB, "
        f"{elapsed:5.2f} s; the results themselves are {held / 2**20:.1f} MiB"
    )
    pixel_bytes = budget * 3 * processor.patch_size**2 * 4
    print(f"  for scale: one full pack's float32 pixel_values is {pixel_bytes / 2**20:.1f} MiB")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench_processor.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_threads_argument(parser)
    parser.add_argument(
        "--images", type=positive_int, default=84, help="images in the processor benchmark (default: 84)"
    )
    parser.add_argument(
        "--encode-images",
        type=positive_int,
        default=2000,
        help="images in the encode_images benchmark (default: 2000)",
    )
    add_budget_argument(parser, default=4096)
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny", help="encoder preset, random weights (default: tiny)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    apply_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    processor = MoonViTImageProcessor()
    with tempfile.TemporaryDirectory() as folder:
        bench_processor(processor, args.images, Path(folder))
    bench_encode(processor, args.preset, args.encode_images, args.max_patches_per_pack)


if __name__ == "__main__":
    main()
