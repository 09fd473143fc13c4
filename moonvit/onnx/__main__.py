"""Export a checkpoint's encoder (and projector) to one ONNX graph that takes any pack.

python -m moonvit.onnx --checkpoint DIR --out encoder.onnx [--projector] [--dtype fp32|fp16] [--opset N]

After writing the graph (checked with onnx.checker), it runs a small pack the export
never saw through ONNX Runtime's CPU provider and through PyTorch, and fails if they
differ by more than the dtype allows. A classic ViT / DeiT folder (transformers', timm's or
this package's) exports its tower the same way (it has no projector).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..cli import (
    ArgumentParser,
    add_checkpoint_argument,
    add_dtype_argument,
    add_opset_argument,
    exit_on,
    one_line_warnings,
    output_file,
    torch_dtype,
)
from ..families.vit.model import ClassicViT
from ..files import disk_full_error
from ..model.encoder import MoonViT
from ..model.interface import tower_name
from ..weights.storage import CheckpointError
from .export import OnnxUnavailableError, compare_with_model, export_onnx, exported_outputs
from .inputs import input_names

# The check's pack: odd aspect ratios, unlike the exporter's example, and a clip where the tower takes them.
CHECK_IMAGES = [(2, 10), (6, 4), (4, 4)]
CHECK_CLIP = (2, 4, 6)
# A classic ViT's: odd sides, one grid wider and one taller than most tables, and the table's own grid.
CHECK_VIT_IMAGES = [(3, 10), (17, 5)]
# Largest relative error the check accepts per dtype (float16 rounds every activation to 11 bits).
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2}


class ParityError(RuntimeError):
    """The exported graph and the PyTorch model disagree on the check's pack."""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m moonvit.onnx",
        description=__doc__.split("\n")[0],
        epilog="The graph takes moonvit.onnx.onnx_inputs(config, pixel_values, grid_hws).",
    )
    add_checkpoint_argument(parser, required=True)
    parser.add_argument("--out", type=output_file, required=True, help="the .onnx file to write")
    parser.add_argument(
        "--projector",
        action="store_true",
        help="also export the checkpoint's projector: the graph then returns the projected tokens too",
    )
    add_dtype_argument(
        parser,
        "fp32",
        "the graph's weights and outputs (pixel values stay float32)",
        choices=("fp32", "fp16"),
    )
    add_opset_argument(parser)
    parser.add_argument(
        "--no-check", action="store_true", help="skip the ONNX Runtime vs PyTorch check on a sample pack"
    )
    return parser


def export(args: argparse.Namespace) -> dict[str, Any]:
    """Load, export, check; returns the summary it prints."""
    dtype = torch_dtype(args.dtype)
    encoder: MoonViT | ClassicViT = MoonViT.from_pretrained(args.checkpoint, dtype=dtype, device="cpu")
    if not isinstance(encoder, (MoonViT, ClassicViT)):
        raise CheckpointError(
            f"{args.checkpoint} holds the {tower_name(encoder.config)} ({type(encoder).__name__}): "
            "python -m moonvit.onnx exports one MoonViT or ViT tower (a MoonViT or ClassicViT module)"
        )
    projector = None
    if args.projector and isinstance(encoder, ClassicViT):
        raise CheckpointError(
            f"{args.checkpoint} holds the {tower_name(encoder.config)}, which has no projector: drop --projector"
        )
    if args.projector:
        from ..model.projector import MoonViTProjector

        projector = MoonViTProjector.from_pretrained(args.checkpoint, dtype=dtype, device="cpu")
    # the export takes seconds to minutes: say what runs before it
    print(f"exporting {args.checkpoint} to {args.out} ({args.dtype}, opset {args.opset})", flush=True)
    start = time.perf_counter()
    with removed_unless_finished(args.out):
        path = export_onnx(encoder, args.out, projector, opset=args.opset)
    summary: dict[str, Any] = {
        "path": str(path),
        "seconds": round(time.perf_counter() - start, 1),
        "megabytes": round(sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) / 2**20, 1),
        "dtype": args.dtype,
        "opset": args.opset,
        "inputs": list(input_names(encoder.config)),
        "outputs": list(exported_outputs(encoder.config, projector is not None)),
    }
    print(
        f"wrote {path} ({summary['megabytes']} MB, {args.dtype}, opset {args.opset}) in {summary['seconds']} s\n"
        f"  inputs:  {', '.join(summary['inputs'])}\n  outputs: {', '.join(summary['outputs'])}"
    )
    if not args.no_check:
        summary["check"] = check(path, encoder, projector, args.dtype)
    return summary


def graph_files(path: Path) -> dict[Path, tuple[int, int, int] | None]:
    """The graph's files (``path`` and its ``.data`` beside it), each with its (inode, mtime, size) or None:
    what tells a file written since from one that was there before."""

    def signature(file: Path) -> tuple[int, int, int] | None:
        try:
            info = file.stat()
        except FileNotFoundError:
            return None
        return info.st_ino, info.st_mtime_ns, info.st_size

    return {file: signature(file) for file in (path, path.with_name(path.name + ".data"))}


def written_since(before: dict[Path, tuple[int, int, int] | None]) -> list[Path]:
    """The files of :func:`graph_files` written (created or changed) since ``before`` was taken."""
    now = graph_files(next(iter(before)))
    return [file for file, signature in now.items() if signature is not None and signature != before[file]]


@contextmanager
def removed_unless_finished(path: Path) -> Iterator[None]:
    """Remove the graph files written in the block when Ctrl-C or a full disk cuts it short: no partly
    written graph is left looking whole. A file from before, not yet overwritten, is kept."""
    before = graph_files(path)
    try:
        yield
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt) or disk_full_error(error) is not None:
            for file in written_since(before):
                file.unlink()
        raise


def kept_graph(path: Path, before: dict[Path, tuple[int, int, int] | None]) -> str:
    """What Ctrl-C keeps: the graph once written whole (its check against PyTorch cut short), else nothing."""
    if path in written_since(before):
        return f"{path} is written whole; its check against PyTorch was cut short (the same command runs both again)"
    return f"nothing was written to {path}"


def check(path: Any, encoder: MoonViT | ClassicViT, projector: Any, dtype: str) -> dict[str, float] | None:
    """Run the check's pack through ONNX Runtime and PyTorch; None where onnxruntime is missing."""
    try:
        import onnxruntime
    except ImportError:
        print("  check skipped: onnxruntime is not installed (pip install 'moonvit[onnx]')")
        return None
    grids = [(1, h, w) for h, w in CHECK_IMAGES]
    if isinstance(encoder, ClassicViT):
        side = encoder.config.grid_side
        grids = [(1, h, w) for h, w in CHECK_VIT_IMAGES] + [(1, side, side)]
    elif encoder.config.max_frames >= CHECK_CLIP[0]:
        grids.append(CHECK_CLIP)
    patches = sum(t * h * w for t, h, w in grids)
    config = encoder.config
    pixels = np.random.default_rng(0).standard_normal(
        (patches, config.num_channels, config.patch_size, config.patch_size)
    )
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    errors = compare_with_model(session, encoder, pixels, grids, projector)
    shown = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    print(f"  ONNX Runtime (CPU) vs PyTorch on grids {grids}, max relative error: {shown}")
    worst = max(errors, key=lambda name: errors[name])
    if errors[worst] > TOLERANCE[dtype]:
        raise ParityError(
            f"the exported graph's {worst} differs from PyTorch's by {errors[worst]:.1e} relative, "
            f"over the {TOLERANCE[dtype]:.0e} a {dtype} graph allows"
        )
    return errors


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    before = graph_files(args.out)
    errors = (OnnxUnavailableError, ParityError)
    with one_line_warnings(), exit_on(parser, *errors, kept=lambda: kept_graph(args.out, before), writing=args.out):
        return export(args)


if __name__ == "__main__":
    main()
