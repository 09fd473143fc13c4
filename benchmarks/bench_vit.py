"""The classic ViT-B/16 packed against transformers' ViTModel, run as its users run it.

One process, the contenders interleaved on the same weights (transformers' ``ViTModel(ViTConfig())``
with random weights, written by ``save_pretrained`` and read back by ``MoonViT.from_pretrained`` and
``ViTModel.from_pretrained``) and the same pixels:

    python benchmarks/bench_vit.py --threads 2 --repeats 5 --out benchmarks/results/bench_vit.md

1. A mixed pack of eight images of eight sizes (multiples of 16): ours encodes them in one packed
   call; transformers' ViTModel (a) one call per image at its own size
   (``interpolate_pos_encoding=True``: the same tokens, the reference), (b) every image resized to
   224x224 in one batched call (fewer, other tokens), (c) every image padded to the largest height
   and width in one batched call with ``attention_mask`` on the padding (the padding is not attended
   to, but the table is resampled to the padded grid: other positions, so other tokens).
2. Thirty-two 224x224 images: ours as one pack against ViTModel's batched call (B=32).

For each dtype (``--dtypes``) and each of our attention backends (``--attn``): seconds (min and
median of ``--repeats`` after a warm-up call), the ratio transformers / ours from the same run,
the resident memory one call adds at its peak (Linux; ``common.peak_extra_bytes``) and the largest
absolute difference of the patch rows (and CLS rows) from the reference, beside the timing.
Pixels are cut into patches (ours) and resized or padded (transformers) before the clock starts.
The project's goals (printed, not asserted): ours at least 2x one call per image on the mixed pack
and at least 1.2x the batched call on the fixed batch.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
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
from moonvit.media.processor import patchify
from moonvit.model.attention import resolve_attn_implementation
from moonvit.model.openvino_sdpa import OPENVINO_MIN_PATCHES

if TYPE_CHECKING:
    from transformers import ViTModel

PATCH = 16
NATIVE = 224  # ViTConfig's image_size: the table's own 14x14 grid
MIXED_SIZES: list[tuple[int, int]] = [
    (224, 224),
    (320, 192),
    (160, 384),
    (448, 288),
    (256, 256),
    (96, 512),
    (384, 384),
    (208, 144),
]
"""(height, width) px of the mixed pack: 2,321 patches, 8 to 36 patches a side."""
QUICK_SIZES: list[tuple[int, int]] = [(64, 64), (48, 32), (32, 80), (96, 48)]
MIXED_GOAL, FIXED_GOAL = 2.0, 1.2


Rows = tuple[torch.Tensor, torch.Tensor]
"""(patch rows (L, D), CLS rows (N, D)) of a pack's images, in the pack's order."""


@dataclass
class Contender:
    """One way of encoding a case's images: ``run()`` is the timed call, ``rows()`` the tokens to check."""

    name: str
    tokens: str  # what one run attends over, in words
    run: Callable[[], object]
    rows: Callable[[object], Rows | None]
    """The :data:`Rows` of ``run()``'s output, or None where the contender encodes other tokens."""
    ours: bool = False
    note: str = ""  # beside the difference, where the tokens are not the reference's


def images_of(sizes: Sequence[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    """(3, H, W) float32 normal pixels (a processor's normalised range), one per size."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=generator) for h, w in sizes]


def pack_of(images: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our input: (L, 3, 16, 16) patches in raster order, images concatenated, and (N, 2) grids."""
    pixels = torch.cat([patchify(image, PATCH) for image in images])
    grids = torch.tensor([(image.shape[1] // PATCH, image.shape[2] // PATCH) for image in images])
    return pixels, grids


def padded_batch(images: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Every image zero-padded (bottom, right) to the largest height and width: (N, 3, H, W), the
    (N, 1 + H/16 * W/16) int64 attention mask (1: the CLS token and the image's own patches) and
    the padded grid (rows, cols)."""
    height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
    rows, cols = height // PATCH, width // PATCH
    batch = torch.zeros(len(images), 3, height, width)
    mask = torch.zeros(len(images), rows, cols, dtype=torch.int64)
    for n, image in enumerate(images):
        batch[n, :, : image.shape[1], : image.shape[2]] = image
        mask[n, : image.shape[1] // PATCH, : image.shape[2] // PATCH] = 1
    cls = torch.ones(len(images), 1, dtype=torch.int64)
    return batch, torch.cat([cls, mask.flatten(1)], dim=1), (rows, cols)


def takes_attention_mask(peer: ViTModel) -> bool:
    """Whether this transformers' ViTModel.forward takes ``attention_mask`` (older releases do not)."""
    return "attention_mask" in inspect.signature(peer.forward).parameters


def load_peer(folder: Path, dtype: torch.dtype) -> ViTModel:
    """transformers' ViTModel from ``folder`` in ``dtype``, in eval mode, with its default SDPA attention."""
    from transformers import ViTModel

    return ViTModel.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()


def load_ours(folder: Path, dtype: torch.dtype, attn: str) -> MoonViT:
    """Ours from the same folder, as users load it (a ClassicViT), in eval mode."""
    return MoonViT.from_pretrained(folder, dtype=dtype, attn_implementation=attn).eval()


def ours_contenders(ours: MoonViT, attns: Sequence[str], images: Sequence[torch.Tensor]) -> list[Contender]:
    """Ours in one packed call, once per attention backend (one model, the backend set per call)."""
    pixels, grids = pack_of(images)
    pixels = pixels.to(ours.dtype)
    tokens = f"1 pack of {len(images)} images, {int(grids.prod(dim=1).sum()) + len(images):,} tokens"

    def on(attn: str) -> Callable[[], object]:
        def run() -> object:
            ours.set_attn_implementation(attn)
            return ours(pixels, grids)

        return run

    def rows(out: object) -> Rows:
        return out.last_hidden_state, out.prefix_tokens[:, 0]  # type: ignore[attr-defined]

    return [Contender(f"ours, {attn}", tokens, on(attn), rows, ours=True) for attn in attns]


def per_image(peer: ViTModel, images: Sequence[torch.Tensor]) -> Contender:
    """(a) transformers, one call per image at its own size: the reference tokens."""
    pixels = [image.unsqueeze(0).to(peer.dtype) for image in images]

    def run() -> object:
        return [peer(p, interpolate_pos_encoding=True).last_hidden_state[0] for p in pixels]

    def rows(out: object) -> Rows:
        hidden: list[torch.Tensor] = out  # type: ignore[assignment]
        return torch.cat([h[1:] for h in hidden]), torch.stack([h[0] for h in hidden])

    count = sum(image.shape[1] * image.shape[2] // PATCH**2 + 1 for image in images)
    return Contender("transformers (a): one call per image", f"{len(images)} calls, {count:,} tokens", run, rows)


def resized(peer: ViTModel, images: Sequence[torch.Tensor]) -> Contender:
    """(b) transformers, every image resized to 224x224 (bilinear), one batched call: other tokens."""
    batch = torch.cat([F.interpolate(i.unsqueeze(0), size=(NATIVE, NATIVE), mode="bilinear") for i in images])
    batch = batch.to(peer.dtype)
    side = NATIVE // PATCH
    return Contender(
        f"transformers (b): resized to {NATIVE}x{NATIVE}, batched",
        f"B={len(images)} x {side * side + 1} tokens",
        lambda: peer(batch).last_hidden_state,
        lambda out: None,
        note=f"other tokens: every image resized to {NATIVE}x{NATIVE}",
    )


def padded(peer: ViTModel, images: Sequence[torch.Tensor]) -> Contender:
    """(c) transformers, every image padded to the largest, padding masked, one batched call."""
    batch, mask, (rows_, cols) = padded_batch(images)
    batch = batch.to(peer.dtype)

    def rows(out: object) -> Rows:
        hidden: torch.Tensor = out  # type: ignore[assignment]
        patches = [
            hidden[n, 1:].view(rows_, cols, -1)[: i.shape[1] // PATCH, : i.shape[2] // PATCH].flatten(0, 1)
            for n, i in enumerate(images)
        ]
        return torch.cat(patches), hidden[:, 0]

    return Contender(
        "transformers (c): padded to the largest, masked, batched",
        f"B={len(images)} x {rows_ * cols + 1} tokens ({rows_}x{cols} grid)",
        lambda: peer(batch, interpolate_pos_encoding=True, attention_mask=mask).last_hidden_state,
        rows,
        note=f"other positions: the table resampled to the padded {rows_}x{cols} grid",
    )


def batched(peer: ViTModel, images: Sequence[torch.Tensor]) -> Contender:
    """transformers' batched call on equal-size images: the reference of the fixed batch."""
    batch = torch.stack(list(images)).to(peer.dtype)
    grid = images[0].shape[1] * images[0].shape[2] // PATCH**2

    def rows(out: object) -> Rows:
        hidden: torch.Tensor = out  # type: ignore[assignment]
        return hidden[:, 1:].flatten(0, 1), hidden[:, 0]

    return Contender(
        "transformers: batched", f"B={len(images)} x {grid + 1} tokens", lambda: peer(batch).last_hidden_state, rows
    )


def diff_text(got: Rows, expected: Rows) -> str:
    """``max |patch rows| (max |CLS rows|)`` of ``got`` against ``expected``."""
    return f"{max_abs(got[0], expected[0]):.1e} ({max_abs(got[1], expected[1]):.1e})"


def reference_rows(reference: Contender) -> Rows:
    """The (patch rows, CLS rows) of one call of ``reference``."""
    rows = reference.rows(reference.run())
    if rows is None:
        raise ValueError(f"{reference.name} encodes other tokens: it cannot be a reference")
    return rows


def case_rows(
    dtype_key: str, contenders: Sequence[Contender], reference: Contender, fp32_reference: Rows, repeats: int
) -> list[str]:
    """One table row per contender: seconds, ratio transformers / ours (medians; mins in brackets),
    peak MiB, and the largest differences from ``reference``'s patch and CLS rows (same dtype) and
    from ``fp32_reference`` (the same reference computed in float32)."""
    times = interleaved_times({c.name: c.run for c in contenders}, repeats)
    outputs: dict[str, object] = {}
    with torch.inference_mode():
        # the call whose peak is measured also gives the tokens that are checked
        peaks = {c.name: peak_extra_bytes(lambda: outputs.__setitem__(c.name, c.run())) for c in contenders}
    tokens = {c.name: c.rows(outputs[c.name]) for c in contenders}
    expected = tokens[reference.name]
    if expected is None:
        raise ValueError(f"{reference.name} encodes other tokens: it cannot be a reference")
    ours = [c for c in contenders if c.ours]
    lines = []
    for c in contenders:
        low, mid = min(times[c.name]), statistics.median(times[c.name])
        if c.ours:
            ratio = "-"
        else:
            ratio = ", ".join(
                (f"{o.name.removeprefix('ours, ')} " if len(ours) > 1 else "")
                + f"{mid / statistics.median(times[o.name]):.2f}x ({low / min(times[o.name]):.2f}x)"
                for o in ours
            )
        got = tokens[c.name]
        if got is None:
            same, wide = c.note, "-"
        else:
            same = "reference" if c is reference else diff_text(got, expected)
            same = f"{same}: {c.note}" if c.note else same
            wide = diff_text(got, fp32_reference)
        lines.append(
            f"| {dtype_key} | {c.name} | {c.tokens} | {low:.3f} | {mid:.3f} | {ratio} | {mib(peaks[c.name])} "
            f"| {same} | {wide} |"
        )
        print(lines[-1], flush=True)
    return lines


TABLE_HEAD = [
    "| dtype | contender | tokens | s min | s median | transformers / ours, median (min) | peak MiB "
    "| max abs diff vs reference, patch rows (CLS) | max abs diff vs fp32 reference, patch rows (CLS) |",
    "|---|---|---|---|---|---|---|---|---|",
]


def describe_sizes(sizes: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"{h}x{w}" for h, w in sizes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_vit.py", description=__doc__.split("\n")[0])
    add_threads_argument(parser)
    parser.add_argument(
        "--repeats", type=positive_int, default=None, help="timed runs per contender, after a warm-up (default: 5)"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        type=bf16_or_fp32,
        default=["fp32", "bf16"],
        help="dtypes to time: fp32, bf16 (default: both)",
    )
    add_attn_rows_argument(parser, "auto")
    parser.add_argument(
        "--depth", type=positive_int, default=None, help="blocks of the ViT-B tower (default: 12, the real depth)"
    )
    parser.add_argument(
        "--images", type=positive_int, default=None, help="images of the fixed 224x224 batch (default: 32)"
    )
    parser.add_argument(
        "--padded",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time (c), the batch padded to the largest image with its padding masked (default: on)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: 2 blocks, 4 small images in the mixed pack, a batch of 4, 1 repeat "
        "(--depth, --images, --repeats still apply)",
    )
    parser.add_argument("--out", type=output_file, help="also write the tables (markdown) here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.threads = apply_threads(args.threads)
    depth = args.depth or (2 if args.quick else 12)
    repeats = args.repeats or (1 if args.quick else 5)
    count = args.images or (4 if args.quick else 32)
    sizes = QUICK_SIZES if args.quick else MIXED_SIZES

    import transformers
    from transformers import ViTConfig, ViTModel

    transformers.utils.logging.disable_progress_bar()
    lines = [
        f"host: {host_line()}",
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"ViT-B/16 at {depth} blocks, random weights, {repeats} timed run(s) after a warm-up"
        + (" (--quick: a smoke test, not figures)" if args.quick else ""),
        "",
    ]
    backends = set()
    for dtype_key in args.dtypes:
        dtype = DTYPES[dtype_key]
        resolved = {attn: resolve_attn_implementation(attn, torch.device("cpu"), dtype) for attn in args.attn}
        backends |= set(resolved.values())
        lines.append(f"our attention, {dtype_key}: " + ", ".join(f"{a} -> {r}" for a, r in resolved.items()))
    if "openvino" in backends:
        lines.append(
            f"(openvino takes items of {OPENVINO_MIN_PATCHES:,} tokens or more; shorter ones run torch's SDPA)"
        )
    print("\n".join(lines), flush=True)

    torch.manual_seed(0)
    source = ViTModel(ViTConfig(num_hidden_layers=depth))
    mixed_images, fixed_images = images_of(sizes, seed=1), images_of([(NATIVE, NATIVE)] * count, seed=2)
    _, probe_mask, (rows, cols) = padded_batch(mixed_images)
    mixed_patches = sum(h * w for h, w in sizes) // PATCH**2
    padded_note = ""
    if not args.padded:
        padded_note = "(c) not run (--no-padded)."
    elif not takes_attention_mask(source):
        padded_note = (
            f"(c) not run: this transformers' ViTModel.forward takes no attention_mask, so padding to "
            f"{rows * PATCH}x{cols * PATCH} would let every image attend to its padding."
        )
    mixed_head = [
        "",
        f"1. Mixed pack: {len(sizes)} images ({describe_sizes(sizes)}; {mixed_patches:,} patches). Ours: one packed "
        f"call; transformers: (a) one call per image (the reference tokens), (b) resized to {NATIVE}x{NATIVE}, "
        f"(c) padded to {rows * PATCH}x{cols * PATCH} with attention_mask (of its {probe_mask.numel():,} tokens, "
        f"{int(probe_mask.sum()):,} are the images'). Goal: (a) / ours >= {MIXED_GOAL}x.",
        *([padded_note] if padded_note else []),
        "",
        *TABLE_HEAD,
    ]
    fixed_head = [
        "",
        f"2. Fixed batch: {count} images of {NATIVE}x{NATIVE}. Ours: one pack; transformers: one batched call "
        f"(the reference tokens). Goal: transformers / ours >= {FIXED_GOAL}x.",
        "",
        *TABLE_HEAD,
    ]
    mixed_lines, fixed_lines = list(mixed_head), list(fixed_head)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source.save_pretrained(folder)
        del source
        with torch.inference_mode():
            peer = load_peer(folder, torch.float32)
            mixed_fp32, fixed_fp32 = (
                reference_rows(c) for c in (per_image(peer, mixed_images), batched(peer, fixed_images))
            )
            del peer
        for dtype_key in args.dtypes:
            ours, peer = load_ours(folder, DTYPES[dtype_key], args.attn[0]), load_peer(folder, DTYPES[dtype_key])
            print("\n".join(mixed_head), flush=True)
            reference = per_image(peer, mixed_images)
            contenders = [*ours_contenders(ours, args.attn, mixed_images), reference, resized(peer, mixed_images)]
            if not padded_note:
                contenders.append(padded(peer, mixed_images))
            mixed_lines += case_rows(dtype_key, contenders, reference, mixed_fp32, repeats)
            print("\n".join(fixed_head), flush=True)
            reference = batched(peer, fixed_images)
            contenders = [*ours_contenders(ours, args.attn, fixed_images), reference]
            fixed_lines += case_rows(dtype_key, contenders, reference, fixed_fp32, repeats)
            del ours, peer
    notes = [
        "",
        "Seconds are per pack (all images); ratios are transformers' seconds over ours from the same "
        "interleaved runs. Differences are the largest absolute difference of each image's patch rows "
        "(CLS rows in brackets) after the final LayerNorm, against the reference in the same dtype and "
        "against the same reference computed in float32 (bf16's own rounding shows there on both sides).",
    ]
    print("\n".join(notes))
    write_report(args.out, "bench_vit.py", argv, [*lines, *mixed_lines, *fixed_lines, *notes])


if __name__ == "__main__":
    main()
