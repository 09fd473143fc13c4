"""The main job: encode images with MoonViT and write their merged visual tokens.

    python -m moonvit                       # built-in sample images, random `small` preset
    python -m moonvit --checkpoint DIR --images a.jpg b.png --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from . import __version__
from .config import PRESETS
from .model import MoonViT
from .packing import iter_encode_images
from .processor import MoonViTImageProcessor, image_size, load_image

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def sample_images() -> dict[str, Image.Image]:
    """Procedural images of assorted sizes and aspect ratios (no files, no downloads)."""
    def rgb(array: np.ndarray) -> Image.Image:
        return Image.fromarray(np.clip(array, 0, 255).astype(np.uint8), "RGB")

    def grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m moonvit", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, help="local checkpoint folder (Kimi-VL release or moonvit format)")
    source.add_argument("--preset", choices=sorted(PRESETS), default="small", help="random-init preset (default: small)")
    parser.add_argument("--images", nargs="+", type=Path, help="image files (default: built-in samples)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype (default: bf16)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attn", default="auto", choices=["auto", "flash_attention_2", "sdpa", "eager"])
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--max-patches-per-pack", type=int, default=16384, help="patch budget of one forward")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random-init preset")
    parser.add_argument("--out", type=Path, default=Path("outputs/demo"), help="output folder")
    parser.add_argument("--save-checkpoint", type=Path,
                        help="also write the encoder and processor settings here (a checkpoint folder)")
    parser.add_argument("--save-images", type=Path, help="also write the input images here as PNG")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    if args.checkpoint:
        encoder = MoonViT.from_pretrained(args.checkpoint, dtype=dtype, device=args.device, attn_implementation=args.attn)
        processor = MoonViTImageProcessor.from_pretrained(args.checkpoint)
        source = str(args.checkpoint)
    else:
        torch.manual_seed(args.seed)
        encoder = MoonViT.from_preset(args.preset, attn_implementation=args.attn).to(args.device, dtype).eval()
        processor = MoonViTImageProcessor()
        source = f"preset {args.preset} (random weights, seed {args.seed})"
    images = {path.name: path for path in args.images} if args.images else sample_images()
    if args.save_checkpoint:
        encoder.save_pretrained(args.save_checkpoint)
        processor.save_pretrained(args.save_checkpoint)
    if args.save_images:
        args.save_images.mkdir(parents=True, exist_ok=True)
        for name, image in images.items():
            load_image(image).save(args.save_images / f"{Path(name).stem}.png")

    start = time.perf_counter()
    results = list(
        iter_encode_images(encoder, processor, list(images.values()), max_patches_per_pack=args.max_patches_per_pack)
    )
    seconds = time.perf_counter() - start

    print(f"moonvit {__version__}: {source}, {args.dtype} on {args.device}, {torch.get_num_threads()} threads")
    print(f"{'image':<24} {'size':>11} {'grid':>9} {'tokens':>7} {'mean':>8} {'std':>7}")
    summary = []
    for name, result in zip(images, results):
        width, height = image_size(images[name])
        h, w = result.grid_hw
        feats = result.tokens.float()
        print(
            f"{name:<24} {f'{width}x{height}':>11} {f'{h}x{w}':>9} {feats.shape[0]:>7} "
            f"{feats.mean():>8.4f} {feats.std():>7.4f}"
        )
        summary.append({"image": name, "size": [width, height], "grid_hw": [h, w], "num_tokens": feats.shape[0]})
    patches = sum(h * w for h, w in (r.grid_hw for r in results))
    print(f"{len(results)} images, {patches} patches in {seconds:.2f} s ({patches / seconds:.0f} patches/s)")

    args.out.mkdir(parents=True, exist_ok=True)
    save_file({s["image"]: r.tokens.float().contiguous() for s, r in zip(summary, results)}, args.out / "merged.safetensors")
    (args.out / "summary.json").write_text(json.dumps({"source": source, "dtype": args.dtype, "images": summary}, indent=2))
    print(f"merged tokens (n, 4, D) per image written to {args.out / 'merged.safetensors'}")


if __name__ == "__main__":
    main()
