"""Export a checkpoint's tower and projector as a llama.cpp mmproj GGUF file.

python -m moonvit.gguf --checkpoint DIR_OR_HUB_ID --out mmproj.gguf [--dtype f32|f16|bf16]
                       [--projector-type kimik25|kimivl] [--projector-from DIR_OR_HUB_ID]

Then, with llama.cpp: llama-mtmd-cli -m LLM.gguf --mmproj mmproj.gguf --image photo.jpg -p "Describe it."
"""

from __future__ import annotations

import argparse
from typing import Any

from ..cli import ArgumentParser, add_checkpoint_argument, add_shared_arguments, exit_on, one_line_warnings, output_file
from ..media.processor import MoonViTImageProcessor
from ..model.encoder import MoonViT
from ..weights.storage import CheckpointError
from .export import GGUF_DTYPES, PROJECTOR_TYPES, GgufUnavailableError, export_gguf

# Other spellings of llama.cpp's dtype names: this package's other command lines' and torch's.
DTYPE_ALIASES = {"fp32": "f32", "float32": "f32", "fp16": "f16", "float16": "f16", "half": "f16", "bfloat16": "bf16"}


def gguf_dtype(text: str) -> str:
    """``--dtype``: llama.cpp's name of the matrices' type (f32, f16, bf16), from it or an alias."""
    name = text.strip().lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in GGUF_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose from {', '.join(GGUF_DTYPES)} (no block quantisation: K2.5's 4304-wide MLP is not "
            "a multiple of its 32-value blocks)"
        )
    return name


def load_projector(source: str, checkpoint: str, given: bool, width: int) -> Any:
    """The Kimi projector at ``source``; where the checkpoint has none, a :class:`CheckpointError`
    saying how to attach one (a tower saved by this package, trained or fine-tuned, holds none)."""
    from ..model.projector import MoonViTProjector

    try:
        return MoonViTProjector.from_pretrained(source)
    except CheckpointError as error:
        if given:
            raise
        raise CheckpointError(
            f"no Kimi projector in {checkpoint} ({error}). An mmproj file holds the tower and the projector "
            f"into the LLM's width: pass --projector-from DIR_OR_HUB_ID (a folder or hub id holding a Kimi projector "
            f"for this tower's {width}-wide tokens), or save one into the checkpoint with "
            f"MoonViTProjector(...).save_pretrained({checkpoint!r}) (from moonvit import MoonViTProjector)"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m moonvit.gguf", description=__doc__.split("\n")[0])
    add_checkpoint_argument(
        parser, "a checkpoint folder or hub id holding the tower and its Kimi projector", required=True
    )
    parser.add_argument("--out", type=output_file, required=True, help="the .gguf file to write")
    parser.add_argument(
        "--dtype",
        type=gguf_dtype,
        default="f32",
        metavar="{" + ",".join(GGUF_DTYPES) + "}",
        help="the matrices' dtype in the file (norms, biases and the position table stay f32; fp32, fp16, "
        "float16, bfloat16 are accepted too) (default: f32)",
    )
    parser.add_argument(
        "--projector-type",
        choices=PROJECTOR_TYPES,
        default="kimik25",
        help="llama.cpp's graph to run it with: kimik25 (default: this package's numbers, K2.5's image "
        "markers) or kimivl (Kimi-VL towers: as llama.cpp's converter writes them, with its graph's deviations)",
    )
    add_shared_arguments(parser, "projector_from", projector_from={"what": "Kimi projector"})
    parser.add_argument("--name", default=None, help="general.name in the file (default: the checkpoint's folder name)")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    with one_line_warnings(), exit_on(parser, ValueError, GgufUnavailableError):
        encoder = MoonViT.from_pretrained(args.checkpoint, dtype=None)
        given = args.projector_from is not None
        source = args.projector_from if given else args.checkpoint
        projector = load_projector(source, args.checkpoint, given, encoder.config.hidden_size)
        processor = MoonViTImageProcessor.from_pretrained(args.checkpoint)
        name = args.name or str(args.checkpoint).rstrip("/").rsplit("/", 1)[-1]
        summary = export_gguf(
            encoder,
            projector,
            processor,
            args.out,
            dtype=args.dtype,
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
