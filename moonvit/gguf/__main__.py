"""Export a checkpoint's tower and projector as a llama.cpp mmproj GGUF file.

python -m moonvit.gguf --checkpoint DIR_OR_HUB_ID --out mmproj.gguf [--dtype f32|f16|bf16]
                       [--projector-type kimik25|kimivl]

Then, with llama.cpp: llama-mtmd-cli -m LLM.gguf --mmproj mmproj.gguf --image photo.jpg -p "Describe it."
"""

from __future__ import annotations

import argparse
from typing import Any

from ..cli import add_checkpoint_argument, add_dtype_argument, exit_on, one_line_warnings, output_file
from ..media.processor import MoonViTImageProcessor
from ..model.encoder import MoonViT
from .export import PROJECTOR_TYPES, GgufUnavailableError, export_gguf

# The package's dtype names (moonvit.cli) and llama.cpp's for the file's matrices.
LLAMA_CPP_DTYPES = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moonvit.gguf", description=__doc__.split("\n")[0])
    add_checkpoint_argument(
        parser, "a checkpoint folder or hub id holding the tower and its Kimi projector", required=True
    )
    parser.add_argument("--out", type=output_file, required=True, help="the .gguf file to write")
    add_dtype_argument(
        parser,
        "fp32",
        "the matrices' dtype in the file (f32, f16, bf16; norms, biases and the position table stay f32)",
        choices=("fp32", "fp16", "bf16"),
    )
    parser.add_argument(
        "--projector-type",
        choices=PROJECTOR_TYPES,
        default="kimik25",
        help="llama.cpp's graph to run it with: kimik25 (default: this package's numbers, K2.5's image "
        "markers) or kimivl (Kimi-VL towers: as llama.cpp's converter writes them, with its graph's deviations)",
    )
    parser.add_argument("--name", default=None, help="general.name in the file (default: the checkpoint's folder name)")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    with one_line_warnings(), exit_on(parser, ValueError, GgufUnavailableError):
        from projector import MoonViTProjector

        encoder = MoonViT.from_pretrained(args.checkpoint, dtype=None)
        projector = MoonViTProjector.from_pretrained(args.checkpoint)
        processor = MoonViTImageProcessor.from_pretrained(args.checkpoint)
        name = args.name or str(args.checkpoint).rstrip("/").rsplit("/", 1)[-1]
        summary = export_gguf(
            encoder,
            projector,
            processor,
            args.out,
            dtype=LLAMA_CPP_DTYPES[args.dtype],
            projector_type=args.projector_type,
            name=name,
        )
    print(
        f"wrote {summary.path}: {summary.projector_type}, {summary.dtype}, {summary.tensors} tensors, "
        f"{summary.bytes / 2**20:.1f} MiB"
    )
    return {"path": str(summary.path), "projector_type": summary.projector_type, "dtype": summary.dtype}


if __name__ == "__main__":
    main()
