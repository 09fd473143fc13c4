"""Can preprocessing keep up with the encoder? The image processor (JPEG decode, resize, normalise,
patchify) and the video processor (decode, sample, resize, patchify a 4-frame 1080p chunk) against
the Kimi-K2.5 tower's own rate on the same inputs, in one run.

    python benchmarks/bench_pipeline.py --threads 2 --depth 2 --out benchmarks/results/bench_pipeline.txt

The photos are scikit-learn's two sample photographs cropped and resized to 448x448 and saved as
JPEG; the clip is a synthetic 1920x1080 H.264 video written with PyAV (moving gradients and
noise, 30 fps). The encoder (random weights, ``--dtype``) is timed at ``--depth`` blocks and at 0,
and its per-block time scaled to 27 blocks, as in bench_cpu.py. The processors run on one thread
(they are Pillow / PyAV code); the encoder on ``--threads``.
"""

from __future__ import annotations

import argparse
import fractions
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import host_line, seconds, write_report
from PIL import Image

from moonvit import MoonViT, MoonViTImageProcessor, preset_config
from moonvit.cli import DTYPES, add_threads_argument, apply_threads, output_file, positive_int
from moonvit.media.video import MoonViTVideoProcessor

SIDE = 448
CLIP = (1920, 1080, 30, 4.0)  # width, height, fps, seconds


def write_photos(folder: Path, count: int) -> list[Path]:
    """``count`` 448x448 JPEGs cut from scikit-learn's sample photographs."""
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(array) for array in load_sample_images().images]
    paths = []
    for i in range(count):
        photo = photos[i % len(photos)]
        left = (i * 37) % (photo.width - photo.height + 1)
        crop = photo.crop((left, 0, left + photo.height, photo.height)).resize((SIDE, SIDE), Image.Resampling.BICUBIC)
        paths.append(folder / f"photo{i:03d}.jpg")
        crop.save(paths[-1], quality=90)
    return paths


def write_clip(path: Path) -> Path:
    """A 1080p H.264 clip: drifting colour gradients with noise, so the codec has real work."""
    import av

    width, height, fps, duration = CLIP
    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fractions.Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(int(fps * duration)):
            base = np.stack([xs / width, ys / height, (xs + ys + 8 * i) % 256 / 256], axis=-1) * 200
            noise = rng.integers(0, 40, (height // 8, width // 8, 3)).repeat(8, 0).repeat(8, 1)
            frame = np.clip(base + noise, 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def encoder_seconds(
    pixels: torch.Tensor, grid_thws: torch.Tensor, depth: int, dtype: torch.dtype, repeats: int
) -> float:
    """Seconds of one full-depth (27-block) forward: timed at ``depth`` blocks and at 0, per-block time scaled."""
    times = {}
    for blocks in (depth, 0):
        torch.manual_seed(0)
        model = MoonViT(preset_config("so400m-3d", num_hidden_layers=blocks)).to(dtype).eval()
        model.set_position_cache()
        x = pixels.to(dtype)
        with torch.inference_mode():
            model(x, grid_thws)  # warm-up
            times[blocks] = statistics.median(seconds(lambda: model(x, grid_thws)) for _ in range(repeats))
    return times[0] + 27 * max(times[depth] - times[0], 0.0) / depth


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_pipeline.py", description=__doc__.split("\n")[0])
    add_threads_argument(parser)
    parser.add_argument("--depth", type=positive_int, default=2, help="blocks timed, scaled to 27 (default: 2)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="encoder dtype (default: fp32)")
    parser.add_argument("--photos", type=positive_int, default=32, help="448x448 JPEGs processed (default: 32)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed encoder runs (default: 3)")
    parser.add_argument("--out", type=output_file, help="also write the report here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    threads = apply_threads(args.threads)
    dtype = DTYPES[args.dtype]
    lines = [f"host: {host_line()}", f"torch {torch.__version__}, encoder {args.dtype} on {threads} threads", ""]
    print("\n".join(lines))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        photos = write_photos(root, args.photos)
        clip = write_clip(root / "clip.mp4")

        processor = MoonViTImageProcessor()
        torch.set_num_threads(1)
        processor([photos[0]])  # warm-up
        per_photo = [seconds(lambda p=p: processor([p])) for p in photos]
        batch = processor([photos[0]])
        videos = MoonViTVideoProcessor()
        chunks = videos.chunks(clip)
        per_chunk = [seconds(lambda c=c: videos.process_chunk(c)) for c in chunks]
        chunk_pixels, chunk_thw = videos.process_chunk(chunks[0])
        torch.set_num_threads(threads)

    photo_grid = torch.tensor([[1, *batch.grid_hws[0].tolist()]])
    photo_s = encoder_seconds(batch.pixel_values, photo_grid, args.depth, dtype, args.repeats)
    clip_s = encoder_seconds(chunk_pixels, torch.tensor([chunk_thw]), args.depth, dtype, max(1, args.repeats - 2))

    processor_rate, video_rate = 1 / statistics.median(per_photo), 1 / statistics.median(per_chunk)
    width, height, fps, _ = CLIP
    rows = [
        "| input | preprocessing per s (1 thread) | encoder per s (27 blocks) | preprocessing / encoder |",
        "|---|---|---|---|",
        f"| {SIDE}x{SIDE} JPEG photo, grid {tuple(photo_grid[0, 1:].tolist())} | {processor_rate:.1f} images "
        f"| {1 / photo_s:.3f} images | {processor_rate * photo_s:.0f}x |",
        f"| {width}x{height} H.264 at {fps} fps, 4-frame chunk at {videos.sample_fps:g} fps, grid {tuple(chunk_thw)} "
        f"| {video_rate:.2f} chunks | {1 / clip_s:.4f} chunks | {video_rate * clip_s:.0f}x |",
    ]
    print("\n".join(rows))
    lines += rows
    write_report(args.out, "bench_pipeline.py", argv, lines)


if __name__ == "__main__":
    main()
