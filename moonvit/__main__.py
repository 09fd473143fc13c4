"""The main job: encode images (and videos) with MoonViT and write their merged visual tokens.

python -m moonvit                       # built-in sample images, random `small` preset
python -m moonvit --checkpoint DIR --images a.jpg b.png --dtype bf16

A ViT tower's folder (ViT, DeiT, SigLIP, DINOv2: transformers', timm's or this package's) runs the
same way, by its family's default rule (native resolution for a ViT): each patch is one token
(``merged.safetensors`` holds (n, 1, D) per image), and its pooled vector and prefix rows are written
beside them: ``pooled.safetensors`` (the CLS row after the final norm; SigLIP's MAP head),
``prefix_tokens.safetensors`` (CLS, then DeiT's distillation token or DINOv2's registers; no file for a
tower without prefix tokens, as SigLIP), ``logits.safetensors`` where the folder has a head;
``summary.json`` says what ``pooled`` is and names the prefix rows. Such a tower takes images only.

An OpenVLA / Prismatic folder (the fused DINOv2 + SigLIP backbone) runs by its ``openvla`` rule
(Prismatic's ``image_resize_strategy``, 16 x 16 patches at 224 px): ``merged.safetensors`` holds each
image's (n, 1, 2176) features (DINOv2's 1024, then SigLIP's 1152), and ``projected.safetensors`` its
(n, T) LLM tokens through the projector the folder holds (``summary.json``'s ``projected`` gives T).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from PIL import Image

from . import __version__
from .cli import (
    ENCODER_OPTIONS,
    ArgumentParser,
    add_checkpoint_argument,
    add_shared_arguments,
    apply_threads,
    existing_path,
    exit_on,
    one_line_warnings,
    output_dir,
    torch_dtype,
)
from .encode import EncodedImage, checkpoint_processors, iter_encode_images
from .files import atomic_path, files_below, save_safetensors_atomic, skipped_line, write_text_atomic
from .media.image import IMAGE_EXTENSIONS, ImageInput, ImageLoadError, image_size
from .media.presets import describe_processors, preset_processors
from .media.video import VIDEO_EXTENSIONS, VideoFrames, VideoSource, probe_video
from .model.attention import resolve_attn_implementation
from .model.config import PRESETS
from .model.encoder import MoonViT
from .model.interface import pooled_kind, prefix_token_names, tower_projection
from .names import path_keys, path_record, unique_names


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


def sample_clip() -> VideoFrames:
    """A procedural 3-second clip at 10 fps, 224x160: a bright disc moving across a gradient
    (sampled at 2 fps: 6 frames, a 4-frame and a 2-frame chunk)."""
    y, x = np.mgrid[0:160, 0:224].astype(np.float32)
    frames = []
    for t in range(30):
        disc = np.hypot(x - 20 - 6 * t, y - 80) < 24
        frame = np.stack([x / 224 * 200, y / 160 * 200, np.full_like(x, 60)], -1)
        frame[disc] = (250, 240, 60)
        frames.append(frame.astype(np.uint8))
    return VideoFrames(np.stack(frames), fps=10.0, name="sample-clip")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m moonvit", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    add_checkpoint_argument(source)
    source.add_argument(
        "--preset", choices=sorted(PRESETS), default="small", help="random-init preset (default: small)"
    )
    parser.add_argument(
        "--images",
        nargs="+",
        type=existing_path,
        help="image files or folders (every image below a folder, recursively); keyed by their paths relative to "
        "the folder they share (default, with no --videos either: built-in samples)",
    )
    parser.add_argument(
        "--videos",
        nargs="+",
        type=existing_path,
        help="video files or folders (needs a tower with a temporal table: a Kimi-K2.5 / K2.6 checkpoint or a -3d "
        "preset); with the built-in samples, such a tower also encodes a built-in clip",
    )
    add_shared_arguments(
        parser,
        "dtype",
        *ENCODER_OPTIONS,
        "workers",
        "max_patches_per_pack",
        "side_limit_mode",
        "image_rule",
        "seed",
        dtype={"default": "bf16", "help": "compute dtype", "choices": ("bf16", "fp16", "fp32", "fp64")},
        seed={"help": "seed of the random-init preset"},
    )
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
    if args.image_rule is not None and not args.checkpoint:
        parser.error(f"--image-rule {args.image_rule}: a checkpoint's processor rule; a preset reads its family's")
    written: list[Path] = []
    with one_line_warnings(), exit_on(parser, kept=lambda: kept_outputs(written), writing=args.out):
        run(args, written)


def kept_outputs(written: list[Path]) -> str:
    """What Ctrl-C keeps: nothing until every input is encoded, then each output written so far,
    whole (every file is written atomically)."""
    if not written:
        return "nothing was written (the outputs are written once every input is encoded)"
    return (
        f"{len(written)} output{'s' * (len(written) != 1)} written whole, the last {written[-1]}; "
        "the same command writes them all again"
    )


def expand_folders(paths: list[Path] | None, extensions: frozenset[str], what: str) -> list[Path]:
    """The files given, each folder replaced by the ``extensions`` files below it (sorted); a folder
    with none is an error, other files in it are counted in one warning."""
    files: list[Path] = []
    for path in paths or []:
        if not path.is_dir():
            files.append(path)
            continue
        found, skipped = files_below(path, extensions)
        if not found:
            raise ImageLoadError(f"{path} holds no {what} ({' '.join(sorted(extensions))})")
        if skipped:
            warnings.warn(f"{path}: {skipped_line(skipped)}", stacklevel=2)
        files.extend(found)
    return files


def run(args: argparse.Namespace, written: list[Path] | None = None) -> None:
    """Encode, then write: nothing is written unless every image was encoded; each output written
    whole is added to ``written``."""
    written = [] if written is None else written
    apply_threads(args.threads)
    dtype = torch_dtype(args.dtype)
    attention = resolve_attn_implementation(args.attn, torch.device(args.device), dtype)  # one line if it cannot
    attention += " (auto)" if args.attn == "auto" else ""
    image_files = expand_folders(args.images, IMAGE_EXTENSIONS, "images")
    video_files = expand_folders(args.videos, VIDEO_EXTENSIONS, "videos")
    overrides: dict[str, Any] = {} if args.side_limit_mode is None else {"side_limit_mode": args.side_limit_mode}
    if args.checkpoint:
        encoder = MoonViT.from_pretrained(
            args.checkpoint, dtype=dtype, device=args.device, attn_implementation=args.attn
        )
        # its own processors (K3: 8 fps, its budgets); a classic ViT's: its patch size, no merger
        processors = checkpoint_processors(args.checkpoint, encoder.config, rule=args.image_rule, **overrides)
        processor, video_processor = processors.image, processors.video
        source, family = str(args.checkpoint), None
    else:
        torch.manual_seed(args.seed)
        encoder = MoonViT.from_preset(args.preset, attn_implementation=args.attn).to(args.device, dtype).eval()
        rule = preset_processors(args.preset, **overrides)  # the family's processors: K3's for a -v2 preset
        processor, video_processor, family = rule.image, rule.video, rule.family
        source = f"preset {args.preset} (random weights, seed {args.seed})"
    keys = path_keys([*image_files, *video_files])
    images: dict[str, ImageInput] = dict(zip(keys, image_files))
    videos: dict[str, VideoSource] = dict(zip(keys[len(image_files) :], video_files))
    if not image_files and not video_files:  # the built-in samples, only when nothing was given
        images = dict(sample_images())
        if encoder.config.max_frames > 1:
            videos["sample-clip"] = sample_clip()
    if videos:  # before anything is decoded
        video_processor.check_tower(encoder.config.max_frames, f"--videos {next(iter(videos))}")
    inputs: dict[str, ImageInput | VideoSource] = {**images, **videos}
    keys = list(inputs)

    start = time.perf_counter()
    results = list(
        iter_encode_images(
            encoder,
            processor,
            list(inputs.values()),
            max_patches_per_pack=args.max_patches_per_pack,
            video_processor=video_processor,
            workers=args.workers,
        )
    )
    seconds = time.perf_counter() - start

    print(
        f"moonvit {__version__}: {source}, {args.dtype} on {args.device}, {torch.get_num_threads()} threads, "
        f"attention: {attention}"
    )
    takes_video = encoder.config.max_frames > 1
    print(f"processor: {describe_processors(processor, video_processor, takes_video=takes_video, family=family)}")
    print(f"{'input':<24} {'size':>11} {'grid':>11} {'tokens':>7} {'mean':>8} {'std':>7}")
    summary: list[dict[str, Any]] = []
    for result in results:
        key = keys[result.index]
        item = inputs[key]
        width, height = probe_video(item).size if key in videos else image_size(item)  # type: ignore[arg-type]
        name = key if result.chunk is None else f"{key}#{result.chunk}"
        h, w = result.grid_hw
        grid = f"{h}x{w}" if result.chunk is None else f"{result.frames}x{h}x{w}"
        feats = result.tokens.float()
        note = "  scaled down to fit --max-patches-per-pack" if result.rescaled else ""
        if result.timestamp is not None:
            note += f"  from {result.timestamp:.1f} s"
        print(
            f"{name:<24} {f'{width}x{height}':>11} {grid:>11} {feats.shape[0]:>7} "
            f"{feats.mean():>8.4f} {feats.std():>7.4f}{note}"
        )
        entry: dict[str, Any] = {
            "image": name,
            **(path_record(Path(item).absolute()) if isinstance(item, Path) else {"path": None}),
            "size": [width, height],
            "grid_hw": [h, w],
            "num_tokens": feats.shape[0],
            "rescaled": result.rescaled,
        }
        if result.prefix_tokens is not None:  # a ViT tower: its CLS (and distillation or register) rows
            entry["prefix_tokens"] = result.prefix_tokens.shape[0]
        if result.logits is not None:
            entry["predicted_class"] = int(result.logits.argmax())
        if result.chunk is not None:
            entry.update(video=key, chunk=result.chunk, frames=result.frames, timestamp=result.timestamp)
        summary.append(entry)
    patches = sum(r.frames * r.grid_hw[0] * r.grid_hw[1] for r in results)
    print(f"{len(results)} items, {patches} patches in {seconds:.2f} s ({patches / seconds:.0f} patches/s)")

    if args.save_checkpoint:
        encoder.save_pretrained(args.save_checkpoint)
        processor.save_pretrained(args.save_checkpoint)
        if takes_video:  # the folder keeps its video rule (K3: 8 fps, its frame and video budgets)
            video_processor.save_pretrained(args.save_checkpoint)
        written.append(args.save_checkpoint)
    if args.save_images:
        names = unique_names([str(PurePosixPath(key).with_suffix(".png")) for key in images])
        image_entries = [entry for entry in summary if "video" not in entry]
        for entry, image, name in zip(image_entries, images.values(), names):
            target = args.save_images / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(target) as temporary:
                processor.load_image(image).save(temporary, format="PNG")
            entry["saved_as"] = name
            written.append(target)
    args.out.mkdir(parents=True, exist_ok=True)
    save_safetensors_atomic(
        {s["image"]: r.tokens.float() for s, r in zip(summary, results)}, args.out / "merged.safetensors"
    )
    written.append(args.out / "merged.safetensors")
    per_image = {  # the outputs only a ViT tower gives, one row per image
        "prefix_tokens": [r.prefix_tokens for r in results],
        "pooled": [r.pooled for r in results],
        "logits": [r.logits for r in results],
        "projected": projected_tokens(encoder, results),  # a tower that carries its projector (OpenVLA's)
    }
    extra = []
    for name, rows in per_image.items():
        given = [row for row in rows if row is not None]
        if given and len(given) == len(rows) and given[0].numel():  # no file of empty rows (GAP, SigLIP prefix)
            file = args.out / f"{name}.safetensors"
            save_safetensors_atomic({s["image"]: row.float() for s, row in zip(summary, given)}, file)
            written.append(file)
            extra.append(file.name)
    record: dict[str, Any] = {"source": source, "dtype": args.dtype}
    if pooled_kind(encoder.config) is not None:  # a ViT tower: what its pooled vector is, what its prefix rows are
        record["pooled"] = pooled_kind(encoder.config)
        record["prefix_tokens"] = list(prefix_token_names(encoder.config))
    if per_image["projected"][0] is not None:  # the width of the LLM tokens of the tower's own projector
        record["projected"] = {"shape": ["tokens", per_image["projected"][0].shape[-1]]}
    write_text_atomic(args.out / "summary.json", json.dumps({**record, "images": summary}, indent=2) + "\n")
    written.append(args.out / "summary.json")
    per_token = encoder.config.tokens_per_merge
    print(f"merged tokens (n, {per_token}, D) per image written to {args.out / 'merged.safetensors'}")
    if extra:
        shapes = {"prefix_tokens": "(n_prefix, D)", "pooled": "(D,)", "logits": "(classes,)", "projected": "(n, T)"}
        what = ", ".join(f"{Path(name).stem} {shapes[Path(name).stem]}" for name in extra)
        print(f"per image also {what}, in {', '.join(extra)}")


def projected_tokens(encoder: MoonViT, results: list[EncodedImage]) -> list[torch.Tensor | None]:
    """Each result's LLM tokens (n, T) through the projector the tower carries itself (OpenVLA's fused
    backbone: Prismatic's MLP); Nones for a tower without one (a MoonViT folder's projector is a module of
    its own, which the export reads; a ViT tower has none)."""
    projection = tower_projection(encoder)
    if projection is None:
        return [None] * len(results)
    with torch.no_grad():
        return [projection(result.tokens.to(encoder.device)).cpu() for result in results]


if __name__ == "__main__":
    main()
