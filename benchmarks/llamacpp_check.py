"""This package's mmproj GGUF files run by llama.cpp itself: errors, token counts, the converter, speed.

For each tower family (Kimi-VL's MoonViT, Kimi-K2.5's MoonViT3d; full size, weights randomised
the way the tests randomise them, seed fixed):

1. The converter: the family written as a release folder, llama.cpp's ``convert_hf_to_gguf.py
   --mmproj`` run on it (``--llama-cpp-dir``), and its file compared with ``export_gguf``'s, key
   for key and tensor for tensor (f32 and f16).
2. Errors: llama.cpp's ``mtmd`` encodes photos whose sides are multiples of 28 from the f32 and
   f16 files; each image's projected tokens are compared with this package's in float64 (the
   reference) as ``|llama.cpp - ours| / |ours|`` over the image, beside this package's own fp32
   and bf16 against the same reference. A Kimi-VL tower is run twice: as ``kimik25`` (the
   default export) and as ``kimivl`` (llama.cpp's own projector type for it, with its deviations).
3. Token counts: llama.cpp's count for each image against ``tokens_per_image``, also on sizes
   where llama.cpp's preprocessing departs from Kimi's (``--other-sizes``).
4. Speed: llama.cpp's encode (f16 and f32 files) against this package's fp32 and bf16 forward
   (tower and projector), same images, same threads, interleaved, median of ``--repeats``.

Needs llama-cpp-python with ``mtmd`` (``CMAKE_ARGS="-DLLAMA_CURL=OFF" pip install
llama-cpp-python``) and, for step 1, a llama.cpp source tree (``--llama-cpp-dir``, default
``$LLAMA_CPP_DIR``; skipped without one).

    python benchmarks/llamacpp_check.py --threads 2 [--families kimi-vl k25] [--depth 27]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from common import host_line
from llamacpp import LlamaCppVision, gguf_differences, llama_cpp_available, run_converter, write_text_stub
from PIL import Image

from moonvit import MoonViT, MoonViTImageProcessor, preset_config, tokens_per_image
from moonvit.gguf import export_gguf
from moonvit.media.processor import ImageSizeError
from moonvit_projector import MoonViTProjector, ProjectorConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import randomize_, write_k25_release_folder, write_kimi_vl_folder

TEXT_WIDTH = 2048
FAMILIES = {
    # name: (preset, processor, projector type of llama.cpp's converter)
    "kimi-vl": ("so400m", MoonViTImageProcessor, "kimivl"),
    "k25": ("so400m-3d", MoonViTImageProcessor.kimi_k25, "kimik25"),
}


def size(text: str) -> tuple[int, int]:
    """``HxW`` -> (height, width)."""
    try:
        height, width = (int(side) for side in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is HEIGHTxWIDTH in pixels, e.g. 448x448; got {text!r}") from None
    if height < 1 or width < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return height, width


def photos(sizes: list[tuple[int, int]]) -> list[np.ndarray]:
    """scikit-learn's two sample photos, alternately, resized (bicubic) to each size: (H, W, 3) uint8."""
    from sklearn.datasets import load_sample_images

    sources = [Image.fromarray(image) for image in load_sample_images().images]
    return [
        np.asarray(sources[i % len(sources)].resize((w, h), Image.Resampling.BICUBIC)) for i, (h, w) in enumerate(sizes)
    ]


def relative_error(actual: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(actual.astype(np.float64) - reference) / np.linalg.norm(reference))


class Ours:
    """This package's tower and projector in one dtype: ``tokens(image)`` -> (tokens, width) float64."""

    def __init__(self, encoder: MoonViT, projector: MoonViTProjector, processor: MoonViTImageProcessor, dtype):
        self.encoder = MoonViT(encoder.config).to(dtype).eval()
        self.encoder.load_state_dict(encoder.state_dict())
        self.projector = MoonViTProjector(projector.config).to(dtype).eval()
        self.projector.load_state_dict(projector.state_dict())
        self.processor, self.dtype = processor, dtype

    def batch(self, image: np.ndarray):
        return self.processor(Image.fromarray(image))

    @torch.inference_mode()
    def tokens(self, image: np.ndarray) -> np.ndarray:
        batch = self.batch(image)
        merged = self.encoder(batch.pixel_values.to(self.dtype), batch.grid_hws).merged
        return self.projector(merged).double().numpy()


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def family_models(family: str, depth: int, seed: int) -> tuple[MoonViT, MoonViTProjector, MoonViTImageProcessor]:
    """A family's tower at ``depth`` blocks, its projector (to :data:`TEXT_WIDTH`) and its processor, with
    weights randomised as the tests randomise them."""
    preset, make_processor, _ = FAMILIES[family]
    encoder = randomize_(MoonViT(preset_config(preset, num_hidden_layers=depth)), seed).eval()
    projector = randomize_(MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, TEXT_WIDTH)), seed + 1)
    return encoder, projector.eval(), make_processor()


def open_llamas(
    encoder: MoonViT, projector: MoonViTProjector, processor, work: Path, stub: Path, threads: int
) -> dict[str, LlamaCppVision]:
    """llama.cpp's encoder on this tower's ``kimik25`` mmproj files: {"f16": ..., "f32": ...}."""
    llamas = {}
    for dtype in ("f16", "f32"):
        path = work / f"kimik25-{dtype}.gguf"
        export_gguf(encoder, projector, processor, path, dtype=dtype, projector_type="kimik25")
        llamas[dtype] = LlamaCppVision(path, stub, threads)
    return llamas


def converter_rows(family: str, encoder, projector, processor, llama_dir: Path | None, work: Path) -> list[str]:
    """The converter's file against export_gguf's for one family, f32 and f16."""
    if llama_dir is None or not (llama_dir / "convert_hf_to_gguf.py").is_file():
        return [f"| {family} | - | skipped: no llama.cpp source tree (--llama-cpp-dir) |"]
    folder = work / f"{family}-release"
    if family == "k25":
        write_k25_release_folder(folder, encoder, projector, processor=processor)
    else:
        other = {f"multi_modal_projector.{k}": v for k, v in projector.state_dict().items()}
        write_kimi_vl_folder(folder, encoder, text_hidden_size=TEXT_WIDTH, other_tensors=other)
        processor.save_pretrained(folder)
    rows = []
    for dtype in ("f32", "f16"):
        theirs, ours = work / f"{family}-converter-{dtype}.gguf", work / f"{family}-ours-{dtype}.gguf"
        run_converter(llama_dir, folder, theirs, dtype)
        export_gguf(encoder, projector, processor, ours, dtype=dtype, projector_type=FAMILIES[family][2])
        differences = gguf_differences(ours, theirs)
        verdict = "identical keys, names, shapes, dtypes and bytes" if not differences else "; ".join(differences[:5])
        rows.append(f"| {family} | {dtype} | {verdict} |")
        theirs.unlink()
        ours.unlink()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    unavailable = llama_cpp_available()
    if unavailable:
        raise SystemExit(f"llamacpp_check: {unavailable}")
    torch.set_num_threads(args.threads)
    import llama_cpp

    print(f"host: {host_line()}; torch {torch.__version__}, {args.threads} threads; "
          f"llama-cpp-python {llama_cpp.__version__}")  # fmt: skip
    images, others = photos(args.sizes), photos(args.other_sizes)
    every = [*images, *others]
    errors, counts, speed, converter = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stub = write_text_stub(work / "text.gguf", TEXT_WIDTH)
        for family in args.families:
            llama_type = FAMILIES[family][2]
            encoder, projector, processor = family_models(family, args.depth, args.seed)
            print(f"{family}: {args.depth} x {encoder.config.hidden_size}, converter ...", flush=True)
            converter += converter_rows(family, encoder, projector, processor, args.llama_cpp_dir, work)
            reference = Ours(encoder, projector, processor, torch.float64)
            contenders = {"fp32": Ours(encoder, projector, processor, torch.float32),
                          "bf16": Ours(encoder, projector, processor, torch.bfloat16)}  # fmt: skip
            expected = [reference.tokens(image) for image in images]
            for name, ours in contenders.items():
                row = [relative_error(ours.tokens(image), want) for image, want in zip(images, expected)]
                errors.append((family, f"this package, {name}", row))
            types = ["kimik25", "kimivl"] if llama_type == "kimivl" else ["kimik25"]
            llamas = {}
            for projector_type in types:
                for dtype in ("f32", "f16"):
                    path = work / f"{family}-{projector_type}-{dtype}.gguf"
                    export_gguf(encoder, projector, processor, path, dtype=dtype, projector_type=projector_type)
                    llama = LlamaCppVision(path, stub, args.threads)
                    label = f"llama.cpp {projector_type}, {dtype} file"
                    row: list[float | str] = []
                    for image, want in zip(images, expected):
                        theirs, _ = llama.encode(image)
                        # another token count: llama.cpp resized the image otherwise (its preprocessing)
                        same = theirs.shape == want.shape
                        row.append(relative_error(theirs, want) if same else f"{len(theirs)} tokens, not {len(want)}")
                    errors.append((family, label, row))
                    if projector_type == "kimik25":
                        llamas[dtype] = llama
                        continue
                    if dtype == "f32":
                        counts += [count_row(family, projector_type, image, llama, processor) for image in every]
                    llama.close()
            counts += [count_row(family, "kimik25", image, llamas["f32"], processor) for image in every]
            speed += speed_rows(family, images, llamas, contenders, args.repeats)
            for llama in llamas.values():
                llama.close()
            print(f"{family}: done", flush=True)
    report(args, images, errors, counts, speed, converter)


def count_row(family: str, projector_type: str, image: np.ndarray, llama: LlamaCppVision, processor) -> str:
    """llama.cpp's token count for an image beside ``tokens_per_image`` of Kimi's grid for it."""
    h, w = image.shape[:2]
    theirs = llama.count(image)
    try:
        grid = processor.plan_image(w, h).grid_hw
    except ImageSizeError:  # Kimi-VL: a side over the position table's 512 patches
        return f"| {family} | {projector_type} | {h}x{w} | refused (a side over 512 patches) | - | {theirs} | **no** |"
    expected = tokens_per_image(torch.tensor([grid]), (2, 2))[0]
    agree = "yes" if theirs == expected else "**no**"
    return f"| {family} | {projector_type} | {h}x{w} | {grid[0]}x{grid[1]} | {expected} | {theirs} | {agree} |"


SPEED_HEADER = [
    "| tower | image | patches | llama.cpp f16 | llama.cpp f32 | ours fp32 | ours bf16 | f16 / bf16 | f32 / fp32 |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
]


def speed_rows(family: str, images: list[np.ndarray], llamas: dict, contenders: dict, repeats: int) -> list[str]:
    """Seconds per image of llama.cpp's encode (f16, f32 files) and this package's processor, tower and
    projector (fp32, bf16), interleaved, median of ``repeats``; the ratios are llama.cpp's time over ours
    at comparable precision (rows of :data:`SPEED_HEADER`)."""
    rows = []
    for image in images:
        h, w = image.shape[:2]
        times: dict[str, list[float]] = {name: [] for name in ("llama f16", "llama f32", "ours fp32", "ours bf16")}
        for _ in range(repeats):  # interleaved: each contender sees the same host load
            for dtype in ("f16", "f32"):
                times[f"llama {dtype}"].append(llamas[dtype].encode(image)[1])
            for name, ours in contenders.items():
                times[f"ours {name}"].append(median_seconds(lambda ours=ours: ours.tokens(image), 1))
        medians = {name: statistics.median(values) for name, values in times.items()}
        patches = (h // 14) * (w // 14)
        cells = " | ".join(f"{medians[name]:.2f}" for name in times)
        half, full = medians["llama f16"] / medians["ours bf16"], medians["llama f32"] / medians["ours fp32"]
        rows.append(f"| {family} | {h}x{w} | {patches} | {cells} | {half:.2f}x | {full:.2f}x |")
    return rows


def cell(error: float | str) -> str:
    return error if isinstance(error, str) else f"{error:.1e}"


def report(args, images, errors, counts, speed, converter) -> None:
    sizes = [f"{image.shape[0]}x{image.shape[1]}" for image in images]
    lines = [
        "",
        f"## Per-image relative error against this package in float64 ({args.depth} blocks, seed {args.seed})",
        "",
        f"| tower | computed by | {' | '.join(sizes)} |",
        f"|---|---|{'---:|' * len(sizes)}",
    ]
    lines += [f"| {family} | {label} | {' | '.join(map(cell, row))} |" for family, label, row in errors]
    lines += ["", "## Tokens per image", "",
              "| tower | llama.cpp type | image | Kimi grid | tokens_per_image | llama.cpp | agree |",
              "|---|---|---|---|---:|---:|---|", *counts]  # fmt: skip
    lines += ["", "## llama.cpp's converter against export_gguf", "", "| tower | dtype | result |", "|---|---|---|"]
    lines += converter
    title = f"## Seconds per image (median of {args.repeats}, {args.threads} threads; ratios: llama.cpp's / ours)"
    lines += ["", title, "", *SPEED_HEADER, *speed]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# llamacpp_check\n\nhost: {host_line()}; {args.threads} threads\n{text}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads (default 2)")
    parser.add_argument("--families", nargs="+", choices=tuple(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--depth", type=int, default=27, help="blocks per tower (default 27: the releases)")
    parser.add_argument(
        "--sizes",
        type=size,
        nargs="+",
        default=[(448, 448), (336, 644), (812, 392)],
        help="image sizes HxW on which the preprocessing agrees (sides multiples of 28 within the limits)",
    )
    parser.add_argument(
        "--other-sizes",
        type=size,
        nargs="*",
        default=[(375, 500), (20, 30), (1500, 2000), (140, 9800)],
        help="sizes for the token counts only, where llama.cpp's preprocessing departs from Kimi's",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender and image (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=Path(os.environ["LLAMA_CPP_DIR"]) if os.environ.get("LLAMA_CPP_DIR") else None,
        help="a llama.cpp source tree, for its converter (default $LLAMA_CPP_DIR; without one it is skipped)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this markdown file")
    return parser


if __name__ == "__main__":
    main()
