"""The towers VLA stacks run, packed, against transformers as its users run them: SigLIP2 NaFlex
(so400m/16) and DINOv2 (ViT-L/14).

One process, the contenders interleaved on the same weights (random transformers models written by
``save_pretrained`` and read back by ``MoonViT.from_pretrained`` and the transformers class) and
the same pixels:

    python benchmarks/bench_towers.py --threads 2 --repeats 3 --attn auto sdpa --out benchmarks/results/bench_towers.md

1. SigLIP2 NaFlex, ``Siglip2VisionModel`` at so400m/16's shape:
   (a) at ``--budget`` (256 patches), eight images of mixed aspect ratios sized by NaFlex's own rule
   (:func:`moonvit.families.siglip.processor.naflex_grid`, transformers' bisection), which scales
   every image up or down to fill most of the budget, so its padded batch wastes little; (b) at
   ``--native-budget`` (1024 patches), eight images as a robot's or a VLM's batch mixes them (camera
   frames, crops, small icons) at their own resolution, scaled down only to fit the budget (16 to
   about 1000 patches each). Ours: one packed call, no padding; transformers: its padded batch
   (``max_num_patches`` rows per image, ``pixel_attention_mask`` on the padding: how its processor
   hands images over) and, for the same tokens, one call per image unpadded.
2. DINOv2, ``Dinov2Model`` at ViT-L/14's shape: eight images of eight sizes (multiples of 14).
   Ours: one packed call; transformers: one call per image (its own interface: no mask, so no
   padded batch of mixed sizes).
3. Memory against patches: ours on packs of 1x, 2x and 4x the (b) images (SigLIP2, bf16): peak
   resident bytes added per call, and per patch.

For each dtype and each of our attention backends (``--attn``): seconds (min and median of
``--repeats`` after a warm-up call), the ratio transformers / ours from the same run, the peak
resident memory one call adds (``common.peak_extra_bytes``) and the largest absolute difference of
the patch rows (and pooled vectors) from transformers' unpadded per-image call. Pixels are cut into
patches (ours) and padded (transformers) before the clock starts. The goal (printed, not asserted):
ours at least 2x the padded batch on the mixed pack.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import (
    add_attn_rows_argument,
    bf16_or_fp32,
    host_line,
    interleaved_times,
    max_abs,
    mib,
    peak_extra_bytes,
    write_report,
)

from moonvit import MoonViT
from moonvit.cli import DTYPES, add_threads_argument, apply_threads, output_file, positive_int
from moonvit.families.siglip.processor import naflex_grid
from moonvit.media.processor import patchify

# (height, width) px of the mixed images, before each rule sizes them: aspect ratios 1:1 to 1:6
MIXED_SIZES: list[tuple[int, int]] = [
    (480, 640),
    (1080, 1920),
    (512, 512),
    (300, 1800),
    (900, 600),
    (224, 224),
    (160, 400),
    (720, 1280),
]
NATIVE_SIZES: list[tuple[int, int]] = [
    (224, 224),
    (64, 64),
    (480, 640),
    (128, 256),
    (1080, 1920),
    (320, 240),
    (96, 160),
    (720, 1280),
]
"""(height, width) px of case (b): each read at its own resolution within the native budget."""
QUICK_SIZES: list[tuple[int, int]] = [(64, 96), (48, 48), (32, 128), (80, 40)]
DINO_SIZES: list[tuple[int, int]] = [
    (224, 224),
    (336, 196),
    (168, 448),
    (448, 294),
    (252, 252),
    (98, 518),
    (392, 392),
    (210, 140),
]
QUICK_DINO: list[tuple[int, int]] = [(56, 56), (42, 28), (28, 70), (84, 42)]
GOAL = 2.0

Rows = tuple[torch.Tensor, torch.Tensor]
"""(patch rows (L, D), pooled (N, D)) of a pack's images, in the pack's order."""


@dataclass
class Contender:
    """One way of encoding a case's images: ``run()`` is the timed call, ``rows()`` the tokens to check."""

    name: str
    tokens: str
    run: Callable[[], object]
    rows: Callable[[object], Rows]
    ours: bool = False


def native_grid(height: int, width: int, patch: int, budget: int) -> tuple[int, int]:
    """The image at its own resolution in whole patches, scaled down (aspect kept) only to fit the budget."""
    rows, cols = max(1, height // patch), max(1, width // patch)
    while rows * cols > budget:
        scale = (budget / (rows * cols)) ** 0.5
        rows, cols = max(1, int(rows * scale)), max(1, int(cols * scale))
    return rows, cols


def images_at(grids: Sequence[tuple[int, int]], patch: int, seed: int) -> list[torch.Tensor]:
    """(3, rows * p, cols * p) float32 normal pixels (a processor's normalised range), one per grid."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, r * patch, c * patch, generator=generator) for r, c in grids]


def pack_of(images: Sequence[torch.Tensor], patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our input: (L, 3, p, p) patches in raster order, images concatenated, and (N, 2) grids."""
    pixels = torch.cat([patchify(image, patch) for image in images])
    grids = torch.tensor([(image.shape[1] // patch, image.shape[2] // patch) for image in images])
    return pixels, grids


def naflex_patches(image: torch.Tensor, patch: int) -> torch.Tensor:
    """(rows * cols, p * p * 3): SigLIP2's patch rows, each flattened as (row, column, channel)."""
    c, h, w = image.shape
    return image.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 2, 4, 0).reshape(-1, patch * patch * c)


def ours_contenders(
    ours: torch.nn.Module, attns: Sequence[str], images: Sequence[torch.Tensor], patch: int
) -> list[Contender]:
    """Ours in one packed call, once per attention backend (one model, the backend set per call)."""
    pixels, grids = pack_of(images, patch)
    pixels = pixels.to(next(ours.parameters()).dtype)
    count = int(grids.prod(dim=1).sum())
    prefix = getattr(ours.config, "num_prefix_tokens", 0) * len(images)

    def on(attn: str) -> Callable[[], object]:
        def run() -> object:
            ours.set_attn_implementation(attn)  # type: ignore[operator]
            return ours(pixels, grids)

        return run

    def rows(out: object) -> Rows:
        return out.last_hidden_state, out.pooled  # type: ignore[attr-defined]

    return [
        Contender(f"ours, {attn}: one pack", f"{count + prefix:,} tokens", on(attn), rows, ours=True) for attn in attns
    ]


def siglip2_padded(peer: torch.nn.Module, images: Sequence[torch.Tensor], patch: int, budget: int) -> Contender:
    """transformers' Siglip2VisionModel on its processor's batch: every image's patch rows padded to
    ``budget``, ``pixel_attention_mask`` on the padding, ``spatial_shapes`` its grids."""
    dtype = next(peer.parameters()).dtype
    batch = torch.zeros(len(images), budget, 3 * patch * patch, dtype=dtype)
    mask = torch.zeros(len(images), budget, dtype=torch.int64)
    shapes = torch.tensor([(i.shape[1] // patch, i.shape[2] // patch) for i in images])
    for n, image in enumerate(images):
        rows_ = naflex_patches(image, patch)
        batch[n, : len(rows_)], mask[n, : len(rows_)] = rows_.to(dtype), 1

    def rows(out: object) -> Rows:
        hidden, pooled = out.last_hidden_state, out.pooler_output  # type: ignore[attr-defined]
        return torch.cat([hidden[n, : int(mask[n].sum())] for n in range(len(images))]), pooled

    def run() -> object:
        return peer(pixel_values=batch, pixel_attention_mask=mask, spatial_shapes=shapes)

    return Contender("transformers: padded batch + mask", f"B={len(images)} x {budget} rows", run, rows)


def siglip2_per_image(peer: torch.nn.Module, images: Sequence[torch.Tensor], patch: int) -> Contender:
    """transformers' Siglip2VisionModel, one unpadded call per image: the reference tokens."""
    dtype = next(peer.parameters()).dtype
    calls = [
        (
            naflex_patches(image, patch).unsqueeze(0).to(dtype),
            torch.tensor([(image.shape[1] // patch, image.shape[2] // patch)]),
        )
        for image in images
    ]

    def run() -> object:
        return [
            peer(pixel_values=p, pixel_attention_mask=torch.ones(p.shape[:2], dtype=torch.int64), spatial_shapes=s)
            for p, s in calls
        ]

    def rows(out: object) -> Rows:
        outs: list = out  # type: ignore[assignment]
        return torch.cat([o.last_hidden_state[0] for o in outs]), torch.cat([o.pooler_output for o in outs])

    count = sum(p.shape[1] for p, _ in calls)
    return Contender("transformers: one call per image", f"{len(images)} calls, {count:,} rows", run, rows)


def dinov2_per_image(peer: torch.nn.Module, images: Sequence[torch.Tensor]) -> Contender:
    """transformers' Dinov2Model, one call per image at its own size: the reference tokens."""
    dtype = next(peer.parameters()).dtype
    pixels = [image.unsqueeze(0).to(dtype) for image in images]

    def run() -> object:
        return [peer(p) for p in pixels]

    def rows(out: object) -> Rows:
        outs: list = out  # type: ignore[assignment]
        return torch.cat([o.last_hidden_state[0, 1:] for o in outs]), torch.cat([o.pooler_output for o in outs])

    return Contender("transformers: one call per image", f"{len(images)} calls", run, rows)


def case_rows(label: str, contenders: Sequence[Contender], reference: Contender, repeats: int) -> list[str]:
    """One table row per contender: seconds, transformers / ours (medians; mins in brackets), peak MiB,
    and the largest differences from ``reference``'s patch rows (pooled in brackets)."""
    times = interleaved_times({c.name: c.run for c in contenders}, repeats)
    outputs: dict[str, object] = {}
    with torch.inference_mode():
        peaks = {c.name: peak_extra_bytes(lambda: outputs.__setitem__(c.name, c.run())) for c in contenders}
    expected = reference.rows(outputs[reference.name])
    ours = [c for c in contenders if c.ours]
    lines = []
    for c in contenders:
        low, mid = min(times[c.name]), statistics.median(times[c.name])
        ratio = (
            "-"
            if c.ours
            else ", ".join(
                (f"{o.name.split(':')[0].removeprefix('ours, ')} " if len(ours) > 1 else "")
                + f"{mid / statistics.median(times[o.name]):.2f}x ({low / min(times[o.name]):.2f}x)"
                for o in ours
            )
        )
        got = c.rows(outputs[c.name])
        diff = (
            "reference"
            if c is reference
            else f"{max_abs(got[0], expected[0]):.1e} ({max_abs(got[1], expected[1]):.1e})"
        )
        lines.append(
            f"| {label} | {c.name} | {c.tokens} | {low:.3f} | {mid:.3f} | {ratio} | {mib(peaks[c.name])} | {diff} |"
        )
        print(lines[-1], flush=True)
    return lines


TABLE_HEAD = [
    "| case, dtype | contender | tokens | s min | s median | transformers / ours, median (min) | peak MiB "
    "| max abs diff vs one call per image: patch rows (pooled) |",
    "|---|---|---|---|---|---|---|---|",
]


def memory_rows(ours: torch.nn.Module, images: Sequence[torch.Tensor], patch: int, dtype_key: str) -> list[str]:
    """Ours on packs of 1x, 2x and 4x ``images``: the peak resident memory one call adds, and per patch."""
    lines = [
        "",
        f"Memory against patches (ours, SigLIP2, {dtype_key}):",
        "",
        "| images | patches | peak MiB | KiB per patch |",
        "|---|---|---|---|",
    ]
    dtype = next(ours.parameters()).dtype
    for copies in (1, 2, 4):
        pixels, grids = pack_of(list(images) * copies, patch)
        pixels = pixels.to(dtype)
        with torch.inference_mode():
            peak = peak_extra_bytes(lambda: ours(pixels, grids))
        count = int(grids.prod(dim=1).sum())
        per = "n/a" if peak is None else f"{peak / count / 1024:.0f}"
        lines.append(f"| {len(images) * copies} | {count:,} | {mib(peak)} | {per} |")
        print(lines[-1], flush=True)
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_towers.py", description=__doc__.split("\n")[0])
    add_threads_argument(parser)
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed runs per contender (default: 3)")
    parser.add_argument(
        "--dtypes", nargs="+", type=bf16_or_fp32, default=["bf16"], help="dtypes to time: fp32, bf16 (default: bf16)"
    )
    add_attn_rows_argument(parser, "auto")
    parser.add_argument(
        "--budget", type=positive_int, default=256, help="max_num_patches of case (a), NaFlex's rule (default: 256)"
    )
    parser.add_argument(
        "--native-budget",
        type=positive_int,
        default=1024,
        help="max_num_patches of case (b), images at their own resolution (default: 1024)",
    )
    parser.add_argument(
        "--depth", type=positive_int, default=None, help="blocks of each tower (default: the real depths, 27 and 24)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 2 blocks, small widths and images, 1 repeat"
    )
    parser.add_argument("--out", type=output_file, help="also write the tables (markdown) here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.threads = apply_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 3)
    budget = 16 if args.quick else args.budget
    native_budget = 64 if args.quick else args.native_budget

    import transformers
    from transformers import Dinov2Config, Dinov2Model, Siglip2VisionConfig, Siglip2VisionModel

    transformers.utils.logging.disable_progress_bar()
    if args.quick:
        siglip_shape: dict[str, Any] = dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
        )
        dino_shape: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56)
        sizes, native_sizes, dino_sizes = QUICK_SIZES, QUICK_SIZES, QUICK_DINO
    else:  # so400m/16 and ViT-L/14
        siglip_shape = dict(hidden_size=1152, num_hidden_layers=27, num_attention_heads=16, intermediate_size=4304)
        dino_shape = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, image_size=518)
        sizes, native_sizes, dino_sizes = MIXED_SIZES, NATIVE_SIZES, DINO_SIZES
    if args.depth:
        siglip_shape["num_hidden_layers"] = dino_shape["num_hidden_layers"] = args.depth
    patch = 16
    naflex = [naflex_grid(h, w, patch, budget) for h, w in sizes]
    native = [native_grid(h, w, patch, native_budget) for h, w in native_sizes]
    lines = [
        f"host: {host_line()}",
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"random weights, {repeats} timed run(s) after a warm-up"
        + (" (--quick: a smoke test, not figures)" if args.quick else ""),
        f"SigLIP2: {siglip_shape}, patch {patch}. DINOv2: {dino_shape}, patch 14.",
        f"(a) NaFlex at max_num_patches {budget}, grids: {', '.join(f'{r}x{c}' for r, c in naflex)} "
        f"({sum(r * c for r, c in naflex):,} patches; padded: {len(naflex) * budget:,} rows)",
        f"(b) native at max_num_patches {native_budget}, grids: {', '.join(f'{r}x{c}' for r, c in native)} "
        f"({sum(r * c for r, c in native):,} patches; padded: {len(native) * native_budget:,} rows)",
        f"DINOv2 images: {', '.join(f'{h}x{w}' for h, w in dino_sizes)} px",
        "",
        *TABLE_HEAD,
    ]
    print("\n".join(lines), flush=True)
    memory: list[str] = []
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        siglip_folder, dino_folder = Path(tmp, "siglip2"), Path(tmp, "dinov2")
        Siglip2VisionModel(Siglip2VisionConfig(**siglip_shape, patch_size=patch, num_patches=256)).save_pretrained(
            siglip_folder
        )
        Dinov2Model(Dinov2Config(**dino_shape, patch_size=14)).save_pretrained(dino_folder)
        for dtype_key in args.dtypes:
            dtype = DTYPES[dtype_key]
            ours = MoonViT.from_pretrained(siglip_folder, dtype=dtype).eval()
            peer = Siglip2VisionModel.from_pretrained(siglip_folder, dtype=dtype, attn_implementation="sdpa").eval()
            for label, grids, seed, limit in (
                ("(a) NaFlex", naflex, 1, budget),
                ("(b) native", native, 2, native_budget),
            ):
                images = images_at(grids, patch, seed)
                reference = siglip2_per_image(peer, images, patch)
                contenders = [
                    *ours_contenders(ours, args.attn, images, patch),
                    siglip2_padded(peer, images, patch, limit),
                    reference,
                ]
                lines += case_rows(f"SigLIP2 {label}, {dtype_key}", contenders, reference, repeats)
            if dtype_key == args.dtypes[-1]:
                ours.set_attn_implementation(args.attn[0])
                memory = memory_rows(ours, images_at(native, patch, 3), patch, dtype_key)
            del ours, peer
            ours = MoonViT.from_pretrained(dino_folder, dtype=dtype).eval()
            peer = Dinov2Model.from_pretrained(dino_folder, dtype=dtype, attn_implementation="sdpa").eval()
            images = [torch.randn(3, h, w, generator=torch.Generator().manual_seed(4)) for h, w in dino_sizes]
            reference = dinov2_per_image(peer, images)
            lines += case_rows(
                f"DINOv2, {dtype_key}", [*ours_contenders(ours, args.attn, images, 14), reference], reference, repeats
            )
            del ours, peer
    notes = [
        "",
        f"Goal: transformers' padded batch / ours >= {GOAL}x on the mixed pack. Seconds are per pack (all images); "
        "ratios are transformers' seconds over ours from the same interleaved runs. Differences are the largest "
        "absolute difference of the patch rows (pooled vectors in brackets) from transformers' unpadded call per "
        "image, in the same dtype.",
    ]
    print("\n".join(notes + memory))
    write_report(args.out, "bench_towers.py", argv, [*lines, *memory, *notes])


if __name__ == "__main__":
    main()
