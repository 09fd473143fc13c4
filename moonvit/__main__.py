"""The main job: encode images with MoonViT and write their merged visual tokens.

python -m moonvit                       # built-in sample images, random `small` preset
python -m moonvit --checkpoint DIR --images a.jpg b.png --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from PIL import Image

from . import __version__
from .cli import (
    add_budget_argument,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_seed_argument,
    add_side_limit_argument,
    add_threads_argument,
    apply_threads,
    existing_file,
    exit_on,
    one_line_warnings,
    output_dir,
    torch_dtype,
)
from .encode import iter_encode_images
from .files import atomic_path, save_safetensors_atomic, write_text_atomic
from .media.image import ImageInput, image_size
from .media.processor import MoonViTImageProcessor
from .model.attention import attention_names
from .model.config import PRESETS
from .model.encoder import MoonViT
from .names import path_keys, unique_names


def sample_images() -> dict[str, Image.Image]:
    """Procedural images of assorted sizes and aspect ratios (no files, no downloads)."""

    def rgb(array: np.ndarray) -> Image.Image:
        return Image.fromarray(np.clip(array, 0, 255).astype(np.uint8), "RGB")

    def grid(h: int, w: int) -> np.ndarray:
        """(2, h, w) float32 row and column coordinates."""
        return np.mgrid[0:h, 0:w].astype(np.float32)

    y, x = grid(448, 448)
    gradient = np.stack([x / 448 * 255, y / 448 * 255, np.full_like(x, 128)], -1)
    y, x = grid(360, 640)
    checker = (((x // 40) + (y // 40)) % 2 * 200 + 30)[..., None].repeat(3, -1)
    y, x = grid(100, 1000)
    rings = np.sin(np.hypot(x - 500, y - 50) / 6)[..., None] * np.array([120, 60, 30]) + 128
    y, x = grid(1024, 1792)
    stripes = np.stack([np.sin(x / 9) * 100 + 128, np.cos(y / 13) * 100 + 128, (x + y) % 256], -1)
    noise = np.random.default_rng(0).integers(0, 256, (29, 27, 3))
    return {
        "gradient-448x448": rgb(gradient),
        "checker-640x360": rgb(checker),
        "rings-1000x100": rgb(rings),
        "stripes-1792x1024": rgb(stripes),
        "noise-27x29": rgb(noise),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moonvit", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    add_checkpoint_argument(source)
    source.add_argument(
        "--preset", choices=sorted(PRESETS), default="small", help="random-init preset (default: small)"
    )
    parser.add_argument(
        "--images",
        nargs="+",
        type=existing_file,
        help="image files (default: built-in samples); keyed by their paths relative to the folder they share",
    )
    add_dtype_argument(parser, "bf16", "compute dtype", choices=("bf16", "fp16", "fp32", "fp64"))
    add_device_argument(parser)
    parser.add_argument("--attn", default="auto", choices=attention_names(), help="attention backend (default: auto)")
    add_threads_argument(parser)
    add_budget_argument(parser)
    add_side_limit_argument(parser)
    add_seed_argument(parser, "seed of the random-init preset")
    parser.add_argument(
        "--out", type=output_dir, default=Path("outputs/demo"), help="output folder (default: outputs/demo)"
    )
    parser.add_argument(
        "--save-checkpoint",
        type=output_dir,
        help="also write the encoder and processor settings here (a checkpoint folder)",
    )
    parser.add_argument(
        "--save-images", type=output_dir, help="also write the input images here as PNG, under their keys"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    with one_line_warnings(), exit_on(parser):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Encode, then write: nothing is written unless every image was encoded."""
    apply_threads(args.threads)
    dtype = torch_dtype(args.dtype)
    overrides = {} if args.side_limit_mode is None else {"side_limit_mode": args.side_limit_mode}
    if args.checkpoint:
        encoder = MoonViT.from_pretrained(
            args.checkpoint, dtype=dtype, device=args.device, attn_implementation=args.attn
        )
        processor = MoonViTImageProcessor.from_pretrained(args.checkpoint, **overrides)
        source = str(args.checkpoint)
    else:
        torch.manual_seed(args.seed)
        encoder = MoonViT.from_preset(args.preset, attn_implementation=args.attn).to(args.device, dtype).eval()
        processor = MoonViTImageProcessor(**overrides)
        source = f"preset {args.preset} (random weights, seed {args.seed})"
    images: dict[str, ImageInput] = (
        dict(zip(path_keys(args.images), args.images)) if args.images else dict(sample_images())
    )

    start = time.perf_counter()
    results = list(
        iter_encode_images(encoder, processor, list(images.values()), max_patches_per_pack=args.max_patches_per_pack)
    )
    seconds = time.perf_counter() - start

    print(f"moonvit {__version__}: {source}, {args.dtype} on {args.device}, {torch.get_num_threads()} threads")
    print(f"{'image':<24} {'size':>11} {'grid':>9} {'tokens':>7} {'mean':>8} {'std':>7}")
    summary: list[dict[str, Any]] = []
    for (key, image), result in zip(images.items(), results):
        width, height = image_size(image)
        h, w = result.grid_hw
        feats = result.tokens.float()
        note = "  scaled down to fit --max-patches-per-pack" if result.rescaled else ""
        print(
            f"{key:<24} {f'{width}x{height}':>11} {f'{h}x{w}':>9} {feats.shape[0]:>7} "
            f"{feats.mean():>8.4f} {feats.std():>7.4f}{note}"
        )
        summary.append(
            {
                "image": key,
                "path": str(Path(image).absolute()) if isinstance(image, Path) else None,
                "size": [width, height],
                "grid_hw": [h, w],
                "num_tokens": feats.shape[0],
                "rescaled": result.rescaled,
            }
        )
    patches = sum(h * w for h, w in (r.grid_hw for r in results))
    print(f"{len(results)} images, {patches} patches in {seconds:.2f} s ({patches / seconds:.0f} patches/s)")

    if args.save_checkpoint:
        encoder.save_pretrained(args.save_checkpoint)
        processor.save_pretrained(args.save_checkpoint)
    if args.save_images:
        names = unique_names([str(PurePosixPath(key).with_suffix(".png")) for key in images])
        for entry, image, name in zip(summary, images.values(), names):
            target = args.save_images / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(target) as temporary:
                processor.load_image(image).save(temporary, format="PNG")
            entry["saved_as"] = name
    args.out.mkdir(parents=True, exist_ok=True)
    save_safetensors_atomic(
        {s["image"]: r.tokens.float() for s, r in zip(summary, results)}, args.out / "merged.safetensors"
    )
    write_text_atomic(
        args.out / "summary.json",
        json.dumps({"source": source, "dtype": args.dtype, "images": summary}, indent=2) + "\n",
    )
    print(f"merged tokens (n, 4, D) per image written to {args.out / 'merged.safetensors'}")


if __name__ == "__main__":
    main()
