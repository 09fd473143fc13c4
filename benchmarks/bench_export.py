"""Benchmark `python -m moonvit_projector.export`: images/s and tokens/s on a randomly initialised preset.

Builds a checkpoint folder (encoder preset, a "kimi" projector into ``--llm-hidden``, the processor
with ``--in-token-limit``) and ``--images`` JPEG files of assorted sizes (thumbnails to 1280x720)
in a temporary folder, then times one export into an empty output folder (loading, planning,
decoding, encoding, projecting, writing shards and the manifest) and a rerun of the finished
export (which only checks run.json and reassembles the manifest). With ``--workers 0 1 2`` the
export runs once per count into folders of its own, side by side: the share of the encoder's
time spent waiting for decoded images, images/s, and whether the folders are byte-identical.
With ``--engines local ray`` each count runs on both engines (``--engine ray``: decoding in Ray
CPU tasks, ``--workers`` at once, encoding in ``--encoder-actors`` actors, a local Ray started
and stopped by the export), so the price of the Ray pipeline on one machine is read off one run:
its start-up (to the first pack's result) apart from its rate after it.

Example: python benchmarks/bench_export.py --threads 2 --workers 0 1
         python benchmarks/bench_export.py --threads 2 --preset small --workers 1 2 --engines local ray
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from moonvit import PRESETS, MoonViT, MoonViTImageProcessor
from moonvit.cli import (
    add_budget_argument,
    add_dtype_argument,
    add_threads_argument,
    apply_threads,
    non_negative_int,
    positive_int,
)
from moonvit_projector import MoonViTProjector, ProjectorConfig
from moonvit_projector.export import main as export_main

SIZES = [(64, 48), (224, 224), (320, 240), (640, 480), (800, 600), (1280, 720)]


def build_checkpoint(folder: Path, preset: str, llm_hidden: int, in_token_limit: int) -> Path:
    torch.manual_seed(0)
    encoder = MoonViT.from_preset(preset)
    encoder.save_pretrained(folder)
    MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, llm_hidden)).save_pretrained(folder)
    MoonViTImageProcessor(in_token_limit=in_token_limit).save_pretrained(folder)
    return folder


def write_images(folder: Path, count: int) -> None:
    """Smooth random images (so JPEG decoding costs what it does on photos), cycling through SIZES."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for i in range(count):
        width, height = SIZES[i % len(SIZES)]
        coarse = rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
        image.save(folder / f"{i:05d}.jpg", quality=90)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench_export.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_threads_argument(parser)
    parser.add_argument("--images", type=positive_int, default=120, help="images to export (default: 120)")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny", help="encoder preset, random weights (default: tiny)"
    )
    parser.add_argument("--llm-hidden", type=positive_int, default=256, help="projector output width (default: 256)")
    parser.add_argument(
        "--in-token-limit", type=positive_int, default=1024, help="processor patch budget per image (default: 1024)"
    )
    parser.add_argument(
        "--store",
        default="projected",
        choices=["merged", "projected", "both"],
        help="what the export stores (default: projected)",
    )
    add_dtype_argument(parser, "bf16", "export dtype")
    parser.add_argument("--shard-size", type=positive_int, default=32, help="images per shard (default: 32)")
    add_budget_argument(parser, default=4096)
    parser.add_argument(
        "--workers", type=non_negative_int, nargs="+", default=[0],
        help="decoding threads (Ray: decoding tasks at once) to compare, one export each (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--engines", nargs="+", choices=["local", "ray"], default=["local"],
        help="export engines to compare, each with every --workers count (default: local)",
    )  # fmt: skip
    parser.add_argument(
        "--encoder-actors", type=positive_int, default=1, help="--engine ray's encoder actors (default: 1)"
    )
    return parser


def folder_bytes(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    apply_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = build_checkpoint(root / "ckpt", args.preset, args.llm_hidden, args.in_token_limit)
        write_images(root / "images", args.images)
        common = ["--inputs", str(root / "images"), "--checkpoint", str(checkpoint), "--store", args.store]
        common += ["--dtype", args.dtype, "--shard-size", str(args.shard_size), "--device", "cpu"]
        common += ["--max-patches-per-pack", str(args.max_patches_per_pack), "--threads", str(torch.get_num_threads())]
        runs = {}
        for engine in args.engines:
            for workers in args.workers:
                out = root / f"out-{engine}-{workers}"
                command = [*common, "--out", str(out), "--workers", str(workers), "--engine", engine]
                if engine == "ray":
                    command += ["--encoder-actors", str(args.encoder_actors)]
                start = time.perf_counter()
                summary = export_main(command)
                wall = time.perf_counter() - start
                start = time.perf_counter()
                export_main(command)
                rerun = time.perf_counter() - start
                shard_bytes = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
                runs[engine, workers] = (summary, wall, rerun, shard_bytes, folder_bytes(out))

    first_key = next(iter(runs))
    first = runs[first_key][4]
    rates = {key: run[0]["images_per_s"] for key, run in runs.items()}
    for (engine, workers), (summary, wall, rerun, shard_bytes, files) in runs.items():
        actors = f", {args.encoder_actors} encoder actor{'s' * (args.encoder_actors != 1)}" if engine == "ray" else ""
        print(
            f"\nexport of {summary['images']} images ({summary['failed']} failed), preset {args.preset}, "
            f"store {args.store}, {args.dtype}, {torch.get_num_threads()} threads, --engine {engine}, "
            f"--workers {workers}{actors}"
        )
        versus = ""
        if engine == "ray" and ("local", workers) in rates:
            versus = f"; {rates['ray', workers] / rates['local', workers]:.2f}x the local engine's"
        print(
            f"  encode loop: {summary['images_per_s']:.1f} images/s, {summary['tokens_per_s']:.0f} tokens/s "
            f"({summary['tokens_this_run']} tokens in {summary['seconds']:.2f} s{versus}); "
            f"the encoder waited for decoded images {summary['data_share']:.0%} of its time"
        )
        steady = ""
        if engine == "ray" and ("local", workers) in runs:
            local = runs["local", workers][0]["steady_items_per_s"]
            steady = f"; {summary['steady_items_per_s'] / local:.2f}x the local engine's"
        print(
            f"  after the first pack (at {summary['first_pack_s']:.1f} s): "
            f"{summary['steady_items_per_s']:.1f} images/s{steady}"
        )
        print(
            f"  whole command (load, plan, {'start Ray, ' if engine == 'ray' else ''}encode, write, assemble): "
            f"{wall:.2f} s, {summary['images'] / wall:.1f} images/s; shards {shard_bytes / 2**20:.1f} MiB"
        )
        print(f"  rerun of the finished export: {rerun:.2f} s")
        if (engine, workers) != first_key:
            # run.json names neither the engine nor the worker count, so the folders compare whole
            same = "byte-identical to" if files == first else "DIFFERENT from"
            print(f"  output folder {same} --engine {first_key[0]} --workers {first_key[1]}'s")


if __name__ == "__main__":
    main()
