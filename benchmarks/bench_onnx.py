"""ONNX Runtime (CPU provider) against PyTorch eager on the encoder benchmark's packs.

    python benchmarks/bench_onnx.py --depth 4 --threads 2 --out benchmarks/results/bench_onnx.txt

Builds the so400m-3d tower (the real width, random weights) at --depth blocks, exports
it as an fp32 and an fp16 graph (``moonvit.onnx.export_onnx``), and times, per pack, in
one process and interleaved: PyTorch eager in fp32 and bf16 (sdpa attention) and ONNX
Runtime on each graph (``onnx_inputs`` in NumPy plus ``session.run``, as a deployment
calls them). Prints patches/s (median of --repeats), the ratios of ONNX Runtime to PyTorch
in the same precision class, the NumPy inputs' cost and each graph's error against
PyTorch fp32; ONNX Runtime's reduced precision on CPU is also timed as int8 (dynamic
quantization of the fp32 graph). The graph pads every item to the pack's longest
(attention scores of items x heads x longest^2 floats per block): a pack whose scores
would pass --max-score-gib is not run, and the table says so.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from common import PACKS, as_thw, host_line, seconds

from moonvit import MoonViT, preset_config
from moonvit.cli import (
    add_opset_argument,
    add_threads_argument,
    apply_threads,
    output_file,
    positive_float,
    positive_int,
)
from moonvit.onnx import export_onnx, onnx_inputs


def score_gib(grids: torch.Tensor, heads: int) -> float:
    """GiB of one block's float32 attention scores in the graph's padded batch."""
    lengths = grids.prod(dim=1)
    return len(lengths) * heads * int(lengths.max()) ** 2 * 4 / 2**30


def ort_session(path: Path, threads: int) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def relative_error(actual: np.ndarray, reference: torch.Tensor) -> float:
    ref = reference.float().numpy()
    return float(np.abs(actual.astype(np.float32) - ref).max() / np.abs(ref).max())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_onnx.py", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=positive_int, default=4, help="blocks of the tower (default: 4)")
    add_threads_argument(parser)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per contender (default: 3)")
    parser.add_argument(
        "--packs", nargs="+", choices=list(PACKS), default=list(PACKS), metavar="PACK",
        help=f"packs to time (default: all): {', '.join(repr(p) for p in PACKS)}",
    )  # fmt: skip
    parser.add_argument(
        "--max-score-gib",
        type=positive_float,
        default=2.0,
        help="skip ONNX Runtime on packs whose padded attention scores pass this (default: 2 GiB)",
    )
    add_opset_argument(parser)
    parser.add_argument("--out", type=output_file, help="also write the output here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    threads = apply_threads(args.threads)
    torch.manual_seed(0)
    config = preset_config("so400m-3d", num_hidden_layers=args.depth, attn_implementation="sdpa")
    models = {"fp32": MoonViT(config).eval()}
    models["bf16"] = MoonViT(config).to(torch.bfloat16).eval()
    models["bf16"].load_state_dict(models["fp32"].state_dict())

    lines = [
        f"host: {host_line()}",
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__} (CPUExecutionProvider), "
        f"{threads} threads, so400m-3d width at depth {args.depth}, opset {args.opset}",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
            start = time.perf_counter()
            model = MoonViT(config).to(dtype).eval()
            model.load_state_dict(models["fp32"].state_dict())
            path = export_onnx(model, Path(tmp) / f"encoder-{name}.onnx", opset=args.opset)
            sessions[name] = ort_session(path, threads)
            lines.append(f"exported the {name} graph in {time.perf_counter() - start:.0f} s")
        sessions["int8"] = ort_session(quantize(Path(tmp) / "encoder-fp32.onnx"), threads)
        lines += [
            "int8: onnxruntime.quantization.quantize_dynamic of the fp32 graph (int8 weights, activations "
            "quantized per call)",
            "",
            "| pack | patches | padded scores GiB / block | torch fp32 | ORT fp32 | ORT / torch fp32 | torch bf16 "
            "| ORT fp16 | ORT int8 | ORT int8 / torch bf16 | onnx_inputs ms | error ORT fp32 | error ORT fp16 "
            "| error ORT int8 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        print("\n".join(lines), flush=True)
        for pack_name in args.packs:
            lines.append(time_pack(pack_name, models, sessions, args))
            print(lines[-1], flush=True)
    lines += [
        "",
        "Speeds in patches/s: the median of interleaved runs. ORT's time includes onnx_inputs (NumPy), which a",
        "deployment pays on every call. Errors: max |ORT - torch fp32| / max |torch fp32| over merged. Packs",
        "whose padded attention scores pass --max-score-gib are not run. The machine is shared with",
        "other work: ratios measured side by side in one run are what counts.",
    ]
    if args.out:
        command = "python benchmarks/bench_onnx.py " + " ".join(sys.argv[1:] if argv is None else argv)
        args.out.write_text("```\n" + command + "\n```\n\n" + "\n".join(lines) + "\n")


def quantize(path: Path) -> Path:
    """The graph with int8 weights and per-call int8 activations for its matmuls: the CPU provider's
    reduced precision (its float16 kernels are few and slow on x86)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = path.with_name("encoder-int8.onnx")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # its advice to pre-process the graph first, printed on every call
    try:
        quantize_dynamic(path, out, weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)
    return out


def time_pack(pack_name: str, models: dict[str, MoonViT], sessions: dict, args: argparse.Namespace) -> str:
    """One table row: every contender on one pack."""
    grid_list = PACKS[pack_name]
    grids = as_thw(grid_list)
    patches = int(grids.prod(dim=1).sum())
    pixels = torch.randn(patches, 3, 14, 14)
    numpy_pixels, numpy_grids = pixels.numpy(), grids.numpy()
    config = models["fp32"].config

    def torch_call(name: str) -> Callable[[], object]:
        model, inputs = models[name], pixels.to(models[name].dtype)
        return lambda: model(inputs, grids).merged

    def ort_call(name: str) -> Callable[[], list]:
        return lambda: sessions[name].run(None, onnx_inputs(config, numpy_pixels, numpy_grids))

    gib = score_gib(grids, config.num_attention_heads)
    if gib > args.max_score_gib:
        return f"| {pack_name} | {patches} | {gib:.2f} | not run: the padded scores pass --max-score-gib |" + " |" * 10
    contenders = {"torch fp32": torch_call("fp32"), "torch bf16": torch_call("bf16")}
    contenders.update({f"ORT {name}": ort_call(name) for name in sessions})
    with torch.inference_mode():
        reference = models["fp32"](pixels, grids).merged
        times = time_interleaved(contenders, args.repeats)
    inputs_ms = 1e3 * min(seconds(lambda: onnx_inputs(config, numpy_pixels, numpy_grids)) for _ in range(3))
    rate = {name: patches / t for name, t in times.items()}
    errors = {name: relative_error(ort_call(name)()[1], reference) for name in sessions}
    return (
        f"| {pack_name} | {patches} | {gib:.2f} | {rate['torch fp32']:.0f} | {rate['ORT fp32']:.0f} | "
        f"{rate['ORT fp32'] / rate['torch fp32']:.2f}x | "
        f"{rate['torch bf16']:.0f} | {rate['ORT fp16']:.0f} | {rate['ORT int8']:.0f} | "
        f"{rate['ORT int8'] / rate['torch bf16']:.2f}x | {inputs_ms:.1f} | {errors['fp32']:.1e} | "
        f"{errors['fp16']:.1e} | {errors['int8']:.1e} |"
    )


def time_interleaved(contenders: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each contender, runs alternating between them (after a warm-up)."""
    for fn in contenders.values():
        fn()
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            runs[name].append(seconds(fn))
    return {name: statistics.median(values) for name, values in runs.items()}


if __name__ == "__main__":
    main()
