"""``python -m moonvit_projector.export``'s command line: the parser, and the :class:`ExportRun` it gives."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from moonvit.cli import (
    ENCODER_OPTIONS,
    ArgumentParser,
    add_checkpoint_argument,
    add_shared_arguments,
    device_name,
    existing_path,
    exit_on,
    one_line_warnings,
    output_dir,
    positive_int,
    torch_dtype,
    typed_run,
)
from moonvit.model.attention import resolve_attn_implementation

from .run import export, kept_shards
from .settings import ENGINES, STORES, ExportError, ExportRun

__all__ = ["build_parser", "export_run", "main"]

DESCRIPTION = "Pre-compute the visual tokens of a whole image collection, for LLM alignment training."


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m moonvit_projector.export",
        description=DESCRIPTION,
        epilog="Data-parallel: torchrun --nproc-per-node K -m moonvit_projector.export ...; "
        "past one machine: --engine ray --ray-address auto",
    )
    parser.add_argument(
        "--inputs",
        type=existing_path,
        required=True,
        help="image folder (recursive; files with other extensions are skipped and counted), one image or "
        "video file, text file of paths, or JSONL of {id, path} lines",
    )
    add_checkpoint_argument(
        parser,
        help="folder or hub id (owner/name) with the encoder, projector and preprocessor_config.json",
        required=True,
    )
    parser.add_argument("--out", type=output_dir, required=True, help="output folder (resumed if it holds this run)")
    parser.add_argument(
        "--store",
        choices=sorted(STORES),
        default="projected",
        help="merged encoder tokens, projected tokens, or both (default: projected)",
    )
    add_shared_arguments(parser, "projector_from")
    add_shared_arguments(
        parser, "dtype", "max_patches_per_pack", dtype={"default": "bf16", "help": "compute and storage dtype"}
    )
    parser.add_argument("--shard-size", type=positive_int, default=1000, help="images per shard (default: 1000)")
    add_shared_arguments(
        parser,
        "side_limit_mode",
        "image_rule",
        *ENCODER_OPTIONS,
        "workers",
        device={
            "help": "cpu, cuda or cuda:N (each torchrun rank takes cuda:LOCAL_RANK; --engine ray: the encoder "
            "actors' device, which the driver need not have)",
            "here": False,
        },
        workers={"what": "packs of images"},
    )
    parser.add_argument(
        "--cache",
        type=output_dir,
        default=None,
        help="content-addressed token store: images whose tokens it holds for these settings are not "
        "encoded again (not part of run.json: resuming with or without it is the same run)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--engine",
        choices=ENGINES,
        default="local",
        help="local: this process (or torchrun's ranks); ray: packs decoded in Ray CPU tasks (--workers "
        "of them) and encoded by a pool of encoder actors; the same output bytes (default: local)",
    )
    engine.add_argument(
        "--encoder-actors",
        type=positive_int,
        default=1,
        help="--engine ray: encoder actors, each holding the models once (one GPU each on CUDA) (default: 1)",
    )
    engine.add_argument(
        "--ray-address",
        default=None,
        help="--engine ray: join this cluster (auto, or host:port); without it a local Ray is started and stopped",
    )
    return parser


def export_run(args: argparse.Namespace) -> ExportRun:
    """The typed settings of a parsed command line (the one place that reads the namespace)."""
    return typed_run(ExportRun, args)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine == "local":  # this process encodes: it must reach the device
        try:
            device_name(args.device)
        except argparse.ArgumentTypeError as error:
            parser.error(f"argument --device: {error}")
    # Ctrl-C (either engine): one line naming the finished shards, which the same command keeps
    with one_line_warnings(), exit_on(parser, ExportError, kept=lambda: kept_shards(args.out), writing=args.out):
        # a backend that cannot run there is one line before any input is read (the device's type is what
        # counts: each rank's cuda:LOCAL_RANK, or the Ray actors', are of the same type)
        resolve_attn_implementation(args.attn, torch.device(args.device), torch_dtype(args.dtype))
        return export(export_run(args))
