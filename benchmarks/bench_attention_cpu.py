"""Attention over one long item on CPU: the alternatives a user has, side by side, at equal accuracy.

    python benchmarks/bench_attention_cpu.py --threads 2 --out benchmarks/results/bench_attention_cpu.md

One item of so400m's attention (16 heads of 72, bf16) at 4,096 patches (896x896) and at 25,600
(LocateAnything's limit), q, k and v drawn at the spread of a trained tower's logits. Contenders:

- ``sdpa``: ``F.scaled_dot_product_attention``, torch's CPU flash kernel (what the encoder runs);
- ``blocked``: attention written with torch ops, the way one would to beat it: head by head, a
  block of query rows at a time (its scores under 8 MiB) against the whole item, q k^T as a
  float32 GEMM (exact products of the bf16 inputs), a float32 softmax, p v as a bf16 GEMM (the
  arithmetic of the flash kernel, in larger GEMMs);
- ``blocked-bf16``: the same with q k^T as a bf16 GEMM (its scores rounded to bf16 before the softmax);
- ``flex``: FlexAttention compiled by Inductor (its CPU template), where it compiles;
- ``openvino-f32``: OpenVINO's CPU ScaledDotProductAttention computing in float32;
- ``openvino``: the encoder's ``openvino`` backend (:mod:`moonvit.model.openvino_sdpa`), OpenVINO's
  attention in bf16 on q scaled before its one rounding, as the encoder hands it;
- ``openvino-rounded-q``: the same on the rounded q, scaled by it (a second rounding of q);
- ``onnxruntime-f32``: ONNX Runtime's CPU ``com.microsoft.MultiHeadAttention`` (its CPU kernel takes
  float32 only) on float32 copies of the bf16 inputs.

The OpenVINO and ONNX Runtime rows run where they are installed (``pip install 'moonvit[openvino]'``,
``onnxruntime``).

q is drawn in float32, as RoPE leaves it: every contender but ``openvino`` gets it rounded to bf16
(the block's q), ``openvino`` gets q * head_dim ** -0.5 rounded once; the float64 reference takes
the float32 q, so every error counts the one rounding of q.

Each is timed (median of ``--reps`` calls after a warm-up) on ``--heads`` heads (the cost is linear
in heads) and reported per layer of 16 heads,
with its error relative to a float64 reference on the first ``--check-rows`` queries of every head
beside the bf16 reference's own (the float64 result rounded to bf16). ``bench_onnx.py`` times the
whole tower exported to ONNX under ONNX Runtime.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from common import host_line, relative_error, write_report

from moonvit.cli import add_threads_argument, apply_threads, output_file, positive_int
from moonvit.model.flex import flex_unavailable
from moonvit.model.openvino_sdpa import openvino_not_installed, openvino_sdpa, openvino_unavailable

HEADS, HEAD_DIM = 16, 72
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]


SCORES_BYTES = 8 * 2**20
"""A block's float32 scores stay under this (recycled by the allocator, and near the cache)."""


def blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, float32_scores: bool = True) -> torch.Tensor:
    """(heads, n, d) bf16 -> (heads, n, d): softmax(q k^T / sqrt(d)) v, head by head, as many query
    rows at a time as keep the block's float32 scores under :data:`SCORES_BYTES`."""
    scale = q.shape[-1] ** -0.5
    n = k.shape[1]
    rows = max(16, SCORES_BYTES // (4 * n))
    out = torch.empty_like(q)
    for head in range(q.shape[0]):
        keys = (k[head].float() if float32_scores else k[head]).t()
        for start in range(0, q.shape[1], rows):
            block = q[head, start : start + rows]
            scores = torch.mm(block.float() if float32_scores else block, keys).float().mul_(scale)
            out[head, start : start + rows] = torch.mm(scores.softmax(-1).to(v.dtype), v[head])
    return out


def flex_compiled() -> Attention | None:
    if flex_unavailable(torch.device("cpu"), torch.bfloat16) is not None:
        return None
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q[None], k[None], v[None])[0]

    return flex


def openvino_f32() -> Attention | None:
    """OpenVINO's CPU ScaledDotProductAttention computing in float32 on float32 copies of the bf16
    inputs; None where OpenVINO is not installed."""
    if openvino_not_installed() is not None:
        return None
    import openvino as ov
    import openvino.opset13 as ops

    params = [ops.parameter([-1, -1, HEAD_DIM], ov.Type.f32, name=name) for name in "qkv"]
    model = ov.Model([ops.scaled_dot_product_attention(*params, causal=False)], params)
    config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": torch.get_num_threads()}
    request = ov.Core().compile_model(model, "CPU", config).create_infer_request()

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        request.infer([ov.Tensor(t.float().numpy()) for t in (q, k, v)])
        return torch.from_numpy(request.get_output_tensor(0).data.copy()).to(q.dtype)

    return attention


def onnxruntime_f32() -> Attention | None:
    """ONNX Runtime's CPU MultiHeadAttention (float32) on float32 copies of the bf16 (heads, n, d)
    inputs; None where ONNX Runtime or onnx is not installed."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    sessions: dict[int, Any] = {}

    def session(heads: int) -> Any:
        if heads not in sessions:
            width = heads * HEAD_DIM
            io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, "n", width]) for name in "qkvo"]
            node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft",
                                    num_heads=heads)  # fmt: skip
            graph = helper.make_graph([node], "attention", io[:3], io[3:])
            opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
            model = helper.make_model(graph, opset_imports=opsets)
            options = ort.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            options.inter_op_num_threads = 1
            sessions[heads] = ort.InferenceSession(
                model.SerializeToString(),
                options,
                providers=["CPUExecutionProvider"],
            )
        return sessions[heads]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads, n, _ = q.shape
        feeds = {name: t.float().transpose(0, 1).reshape(1, n, -1).numpy() for name, t in zip("qkv", (q, k, v))}
        out = session(heads).run(None, feeds)[0]
        return torch.from_numpy(out).view(n, heads, HEAD_DIM).transpose(0, 1).to(q.dtype)

    return attention


def openvino_backend(scale: float | None) -> Attention | None:
    """The encoder's OpenVINO attention on (heads, n, d) inputs, with ``scale`` (1.0: q comes scaled);
    None where OpenVINO is not installed or this CPU has no bf16 arithmetic."""
    if openvino_not_installed() or openvino_unavailable(torch.device("cpu"), torch.bfloat16):
        return None

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return openvino_sdpa(*(t.transpose(0, 1)[None] for t in (q, k, v)), scale)[0].transpose(0, 1)

    return attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
    """float64 attention of the first ``rows`` queries of every head."""
    q, k, v = (t.double() for t in (q, k, v))
    probs = (q[:, :rows] @ k.transpose(1, 2) * q.shape[-1] ** -0.5).softmax(-1)
    return probs @ v


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench_attention_cpu.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_threads_argument(parser)
    parser.add_argument("--patches", type=positive_int, nargs="+", default=[4096, 25600], help="item lengths")
    parser.add_argument("--heads", type=positive_int, default=4, help="heads timed (scaled to 16) (default: 4)")
    parser.add_argument("--check-rows", type=positive_int, default=256, help="queries checked in float64")
    parser.add_argument("--reps", type=positive_int, default=3, help="timed calls, median taken (default: 3)")
    parser.add_argument(
        "--flex-max-patches", type=positive_int, default=4096,
        help="FlexAttention only on items up to this long (it is 20x slower here) (default: 4096)",
    )  # fmt: skip
    parser.add_argument("--out", type=output_file, default=None, help="also write the tables here (markdown)")
    args = parser.parse_args(argv)
    threads = apply_threads(args.threads)
    contenders: dict[str, Attention | None] = {
        "sdpa": sdpa,
        "blocked": blocked,
        "blocked-bf16": lambda q, k, v: blocked(q, k, v, float32_scores=False),
        "flex": flex_compiled(),
        "openvino-f32": openvino_f32(),
        "openvino": openvino_backend(1.0),
        "openvino-rounded-q": openvino_backend(None),
        "onnxruntime-f32": onnxruntime_f32(),
    }
    lines = [
        f"host: {host_line()}",
        "",
        f"torch {torch.__version__}, {threads} threads, bf16, {HEADS} heads of {HEAD_DIM}",
        "",
    ]
    print("\n".join(lines), flush=True)
    for n in args.patches:
        torch.manual_seed(0)
        # logits of a trained tower spread over about +-10: q and k of norm ~ sqrt(10 * sqrt(d))
        q_float, k, v = (torch.randn(args.heads, n, HEAD_DIM) for _ in range(3))
        q_float, k, v = q_float * 1.8, (k * 1.8).bfloat16(), v.bfloat16()
        q, q_scaled = q_float.bfloat16(), (q_float * HEAD_DIM**-0.5).bfloat16()
        rows = min(args.check_rows, n)
        expected = reference(q_float, k, v, rows)
        own = relative_error(expected.bfloat16(), expected)
        flops = 4 * n * n * HEAD_DIM * HEADS
        table = [
            f"### one item of {n:,} patches",
            "",
            f"bf16 reference's own error (float64 rounded to bf16): {own:.2e}",
            "",
            "| attention | s per layer (16 heads) | GFLOP/s | vs sdpa | error vs float64 |",
            "|---|---|---|---|---|",
        ]
        base = None
        for name, fn in contenders.items():
            if fn is None or (name == "flex" and n > args.flex_max_patches):
                table.append(f"| {name} | not run | | | |")
                continue
            query = q_scaled if name == "openvino" else q
            # warm up off the clock (flex compiles for these very shapes)
            fn(*(t if name == "flex" else t[:, :256] for t in (query, k, v)))
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                out = fn(query, k, v)
                times.append(time.perf_counter() - start)
            took = statistics.median(times) * HEADS / args.heads
            base = took if name == "sdpa" else base
            error = relative_error(out[:, :rows], expected)
            ratio = f"{base / took:.2f}x" if base else ""
            table.append(f"| {name} | {took:.2f} | {flops / took / 1e9:.0f} | {ratio} | {error:.2e} |")
            print(table[-1], flush=True)
        lines += [*table, ""]
        print("\n".join(table), flush=True)
    write_report(args.out, "bench_attention_cpu.py", argv, lines)


if __name__ == "__main__":
    main()
