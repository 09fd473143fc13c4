"""Where a block's time goes, per op class, in ms per 1,000 patches per block.

    python benchmarks/profile_ops.py --depth 4 --threads 2 --out benchmarks/results/profile_ops.md

profiles forwards of the so400m-3d tower (random weights, ``--depth`` blocks) with torch.profiler and
prints, per pack, a table of op classes: matmul, attention, norm, RoPE, activation, copy/layout, other.
The figure is divided by the depth and by the thousands of patches in the pack, so that it reads the
same whatever the depth and pack size (as far as the cost is linear in patches: attention is not,
so it grows with the segment length), and compares across hosts.

How the time is split. The library is not changed: for the profiled runs only, this program wraps
(and restores afterwards) the names the block looks up, each call under a
``torch.profiler.record_function`` label: ``moonvit.model.blocks.linear`` (matmul: the whole linear,
fused bias / GELU / residual epilogue and any bf16 widening included), ``moonvit.model.blocks.apply_rope_``
(RoPE), the attention bound by ``moonvit.model.encoder.bind_attention`` (attention), each block's
``norm0`` / ``norm1`` (norm) and ``Block.forward`` (block). Each profiled op's self time goes to its
nearest labelled ancestor; a GELU that runs as its own op (``aten::gelu``, e.g. after an fp32 matmul)
goes to activation wherever it runs. Ops inside a block but under no finer label are classed by the
outermost op under the block: copies, dtype conversions, concatenations, gathers and views are
copy/layout, GELU is activation, the rest (and the block's Python glue) is other. Ops outside every
block (patch embedding, positions, final norm, merger) are the fixed part.

How it becomes wall time. The profiler slows small ops more than large ones: its own cost per
recorded op is measured first (a loop of tiny adds, profiled and not) and taken off the self time
of each op's parent, where it lands; and only the shares are taken from the profile. Each forward
is also timed without the profiler (median of ``--reps``, interleaved with the same tower at depth
0), the per-block wall time is (wall at depth - wall at depth 0) / depth, and each class gets its
profiled share of block time of that. The fixed part is the depth-0 wall time,
per 1,000 patches per forward (not per block). The tower runs with its opt-in position cache on, the
pack's grid prepared once (as a deployed encoder runs).

What is left of norm and RoPE. Under each table the same calls (the first block's ``norm0`` and RoPE,
on the inputs the forward handed them) are timed repeated back to back, best of 10, their data in cache: the
gap to the forward's figure is what reading data a GEMM has just written, the rest of the cache
evicted, costs. Only a kernel that rotates or normalises inside the GEMM's epilogue closes it.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from common import PACKS, as_thw, bf16_or_fp32, host_line, seconds, write_report
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

import moonvit.model.blocks as blocks_module
import moonvit.model.encoder as encoder_module
from moonvit import MoonViT, preset_config
from moonvit.cli import DTYPES, add_threads_argument, apply_threads, output_file, positive_int
from moonvit.model.attention import AttentionUnavailableError, attention_names, resolve_attn_implementation
from moonvit.model.blocks import Block
from moonvit.model.grid import PackedGrid
from moonvit.model.linear import cpu_bf16_matmul

CLASSES = ("matmul", "attention", "norm", "rope", "activation", "copy/layout", "other")
"""The op classes of the table, in its order."""

PREFIX = "profile_ops::"
LABELS = {f"{PREFIX}{name}": name for name in ("matmul", "attention", "norm", "rope", "block")}
"""record_function label -> its class (``block``: the block's own ops, classed by name)."""

COPY_OPS = frozenset(
    "aten::" + name
    for name in (
        *("copy_", "clone", "contiguous", "cat", "stack", "index_select", "index", "index_put_", "gather"),
        *("to", "_to_copy", "empty", "empty_like", "empty_strided", "new_empty", "new_zeros", "zeros"),
        *("zeros_like", "fill_", "zero_", "reshape", "view", "_unsafe_view", "transpose", "permute", "t"),
        *("flatten", "unflatten", "select", "slice", "narrow", "split", "split_with_sizes", "chunk", "unbind"),
        *("expand", "as_strided", "view_as_real", "view_as_complex", "pad", "constant_pad_nd", "detach"),
        *("alias", "squeeze", "unsqueeze"),
    )
)
"""Ops that move, convert or re-view data without arithmetic on it (copy/layout)."""


# apply_rope where the block still made a rotated copy: the "before" table is measured by this program
ROPE_NAME = "apply_rope_" if hasattr(blocks_module, "apply_rope_") else "apply_rope"
"""The block's RoPE function, by its name in moonvit.model.blocks."""


def is_activation(name: str) -> bool:
    return "gelu" in name


# ---- labels -------------------------------------------------------------------------------------


def labelled(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every call under the profiler label ``PREFIX + label``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(PREFIX + label):
            return fn(*args, **kwargs)

    return call


@contextmanager
def labels(model: MoonViT) -> Iterator[None]:
    """Profiler labels on the block's linears, RoPE, attention, norms and the blocks themselves, for the
    length of the ``with``; everything is put back afterwards (on an exception too)."""
    saved_linear, saved_rope = blocks_module.linear, getattr(blocks_module, ROPE_NAME)
    saved_bind, saved_forward = encoder_module.bind_attention, Block.forward

    def bind_attention(name: str, grid: PackedGrid, **kwargs: Any) -> Callable[..., torch.Tensor]:
        return labelled("attention", saved_bind(name, grid, **kwargs))

    norms = [norm for block in model.encoder.blocks for norm in (cast(Block, block).norm0, cast(Block, block).norm1)]
    blocks_module.linear = labelled("matmul", saved_linear)
    setattr(blocks_module, ROPE_NAME, labelled("rope", saved_rope))
    encoder_module.bind_attention = bind_attention
    Block.forward = labelled("block", saved_forward)  # type: ignore[method-assign]
    for norm in norms:
        norm.forward = labelled("norm", norm.forward)  # an instance attribute over the class's method
    try:
        yield
    finally:
        blocks_module.linear = saved_linear
        setattr(blocks_module, ROPE_NAME, saved_rope)
        encoder_module.bind_attention = saved_bind
        Block.forward = saved_forward  # type: ignore[method-assign]
        for norm in norms:
            del norm.forward


# ---- attribution --------------------------------------------------------------------------------


def classify(event: FunctionEvent) -> str | None:
    """The class of ``event``'s self time, or None outside every block (the fixed part)."""
    top: FunctionEvent = event  # the outermost op below the nearest label
    node: FunctionEvent | None = event
    activation = False
    while node is not None:
        activation = activation or is_activation(node.name)
        label = LABELS.get(node.name)
        if label == "block":
            if node is event:
                return "other"  # the block's own time between ops: Python glue
            if activation:
                return "activation"
            return "copy/layout" if top.name in COPY_OPS else "other"
        if label is not None:
            return "activation" if activation else label
        top, node = node, node.cpu_parent
    return None


def profiler_cost_us(ops: int = 2000) -> float:
    """Microseconds the profiler adds per recorded op: a loop of ``ops`` tiny adds under one label,
    timed with and without the profiler (best of 5 each). The cost lands between the ops, in their
    parent's self time."""
    a, out = torch.ones(16), torch.empty(16)

    def loop() -> None:
        with record_function(PREFIX + "calibration"):
            for _ in range(ops):
                torch.add(a, a, out=out)

    plain = min(seconds(loop) for _ in range(5))
    with profile(activities=[ProfilerActivity.CPU]):
        profiled = min(seconds(loop) for _ in range(5))
    return max(0.0, (profiled - plain) / ops * 1e6)


def profiled_split(
    forward: Callable[[], object], reps: int, model: MoonViT, cost_us: float
) -> tuple[dict[str, float], float]:
    """Profiled self time per class inside blocks, and outside them, in microseconds per forward;
    each op's self time less ``cost_us`` per op directly below it (the profiler's own cost)."""
    with torch.inference_mode(), labels(model):
        forward()  # warm-up with the labels in place
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(reps):
                forward()
    split = dict.fromkeys(CLASSES, 0.0)
    fixed = 0.0
    for event in prof.events():
        kind = classify(event)
        own = max(0.0, event.self_cpu_time_total - cost_us * len(event.cpu_children))
        if kind is None:
            fixed += own
        else:
            split[kind] += own
    return {kind: us / reps for kind, us in split.items()}, fixed / reps


# ---- the same ops on data in cache ---------------------------------------------------------------


def in_cache_ms(forward: Callable[[], object], model: MoonViT, reps: int) -> dict[str, float]:
    """ms per call of the first block's ``norm0`` and RoPE on the inputs the forward hands them, each
    call repeated back to back, so that its data is in cache (in the forward a GEMM has just written
    it, and pushed the rest out). RoPE rotates, in place, the q and k of a (L, 3, heads, head_dim)
    buffer laid out as the block's wqkv output, refilled with the forward's values before each call."""
    layer = cast(Block, model.encoder.blocks[0]).norm0
    rope = getattr(blocks_module, ROPE_NAME)
    seen: dict[str, tuple[torch.Tensor, ...]] = {}

    def norm_spy(x: torch.Tensor) -> torch.Tensor:
        seen.setdefault("norm", (x.clone(),))
        return type(layer).forward(layer, x)

    def rope_spy(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        seen.setdefault("rope", (x.clone(), rotation.clone()))
        return rope(x, rotation)

    layer.forward = norm_spy  # an instance attribute over the class's method, for one forward
    setattr(blocks_module, ROPE_NAME, rope_spy)
    try:
        with torch.inference_mode():
            forward()
    finally:
        del layer.forward
        setattr(blocks_module, ROPE_NAME, rope)

    (x,) = seen["norm"]
    saved, rotation = seen["rope"]
    qk = saved.new_empty(len(saved), 3, *saved.shape[2:])[:, :2]  # q and k of a qkv buffer, as the block's
    norm: list[float] = []
    turn: list[float] = []
    with torch.inference_mode():
        for _ in range(reps + 2):
            norm.append(seconds(lambda: layer(x)))
            qk.copy_(saved)
            turn.append(seconds(lambda: rope(qk, rotation)))
    # the best call: how fast the op runs with its data hot, whatever else the host is doing meanwhile
    return {"norm": min(norm[2:]) * 1e3, "rope": min(turn[2:]) * 1e3}


# ---- the tower ----------------------------------------------------------------------------------


def build(depth: int, dtype: torch.dtype, attn: str) -> MoonViT:
    """The so400m-3d tower at ``depth`` blocks on fixed random weights, position cache on."""
    torch.manual_seed(0)
    config = preset_config("so400m-3d", num_hidden_layers=depth, attn_implementation=attn)
    model = MoonViT(config).to(dtype).eval()
    model.set_position_cache()
    return model


def wall_seconds(forwards: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds per call of each forward, unprofiled, runs alternating between them."""
    times: dict[str, list[float]] = {name: [] for name in forwards}
    with torch.inference_mode():
        for fn in forwards.values():
            fn()  # warm-up
        for _ in range(reps):
            for name, fn in forwards.items():
                times[name].append(seconds(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def pack_report(args: argparse.Namespace, pack_name: str, full: MoonViT, empty: MoonViT, cost_us: float) -> list[str]:
    """The table of one pack."""
    dtype = DTYPES[args.dtype]
    grids = as_thw(PACKS[pack_name])
    patches = int(grids.prod(dim=1).sum())
    p = full.config.patch_size
    pixels = torch.randn(patches, full.config.num_channels, p, p).to(dtype)
    grid, grid0 = full.prepare_grid(grids), empty.prepare_grid(grids)
    forwards = {
        "full": lambda: full(pixels, grid=grid).merged,
        "empty": lambda: empty(pixels, grid=grid0).merged,
    }
    wall = wall_seconds(forwards, args.reps)
    split, fixed_us = profiled_split(forwards["full"], args.reps, full, cost_us)
    cached = in_cache_ms(forwards["full"], full, 10)

    block_us = sum(split.values()) or 1.0
    per_block_s = (wall["full"] - wall["empty"]) / args.depth
    method = "wall - depth-0 wall"
    if per_block_s <= 0:  # timing noise at a small depth: take the profiled block share of the wall time
        per_block_s = wall["full"] * block_us / (block_us + fixed_us) / args.depth
        method = "profiled block share of the wall time (depth-0 difference was not positive)"
    thousands = patches / 1000
    rate = {kind: split[kind] / block_us * per_block_s * 1e3 / thousands for kind in CLASSES}
    remainder = sum(rate[kind] for kind in CLASSES if kind not in ("matmul", "attention"))
    overhead = (block_us / 1e6 / args.depth) / per_block_s

    lines = [
        f"### {pack_name}: {patches} patches, {len(PACKS[pack_name])} item(s)",
        "",
        "| class | ms per 1,000 patches per block | share of block time |",
        "|---|---|---|",
        *(f"| {kind} | {rate[kind]:.2f} | {split[kind] / block_us:.1%} |" for kind in CLASSES),
        f"| **block** | **{per_block_s * 1e3 / thousands:.2f}** | 100% |",
        "",
        f"remainder (neither matmul nor attention): {remainder:.2f} ms per 1,000 patches per block; "
        f"fixed part (depth 0: patch embed, positions, final norm, merger): "
        f"{wall['empty'] * 1e3 / thousands:.2f} ms per 1,000 patches per forward",
        f"wall per forward: {wall['full'] * 1e3:.1f} ms at depth {args.depth}, "
        f"{wall['empty'] * 1e3:.1f} ms at depth 0; "
        f"per-block time from {method}; profiled block time / wall block time: {overhead:.2f}x",
        f"the same calls on data in cache (best of 10, back to back): norm {2 * cached['norm'] / thousands:.2f}, "
        f"rope {cached['rope'] / thousands:.2f} ms per 1,000 patches per block (two norms, one rotation), against "
        f"{rate['norm']:.2f} and {rate['rope']:.2f} in the forward, where the GEMM before each has just written "
        "its input and pushed the rest out of cache",
        "",
    ]
    print("\n".join(lines), flush=True)
    return lines


# ---- command line -------------------------------------------------------------------------------


DEFAULT_PACKS = [name for name in ("448x448 (32x32)", "896x896 (64x64)") if name in PACKS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/profile_ops.py", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=positive_int, default=4, help="blocks to run (default: 4)")
    add_threads_argument(parser)
    parser.add_argument("--dtype", type=bf16_or_fp32, default="bf16", help="bf16 or fp32 (default: bf16)")
    parser.add_argument(
        "--packs", nargs="+", choices=list(PACKS), default=DEFAULT_PACKS, metavar="PACK",
        help=f"packs to profile (default: {', '.join(repr(p) for p in DEFAULT_PACKS)}); "
        f"any of {', '.join(repr(p) for p in PACKS)}",
    )  # fmt: skip
    backends = [name for name in attention_names() if name != "auto"]
    parser.add_argument("--attn", choices=backends, default="sdpa", help="attention backend (default: sdpa)")
    parser.add_argument(
        "--reps", type=positive_int, default=3, help="timed and profiled forwards per pack, each (default: 3)"
    )
    parser.add_argument("--out", type=output_file, help="also write the tables (markdown) here")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.threads = apply_threads(args.threads)
    dtype = DTYPES[args.dtype]
    try:
        resolve_attn_implementation(args.attn, torch.device("cpu"), dtype)
    except AttentionUnavailableError as error:
        parser.error(str(error))
    linears = f", bf16 linears on {cpu_bf16_matmul()} kernels" if args.dtype == "bf16" else ""
    lines = [
        f"host: {host_line()}",
        f"torch {torch.__version__}, {args.threads} threads, {args.dtype}{linears}, attention {args.attn}, "
        f"so400m-3d at depth {args.depth}, {args.reps} reps",
        "",
    ]
    print("\n".join(lines), flush=True)
    cost_us = profiler_cost_us()
    lines += [f"profiler's own cost: {cost_us:.2f} us per op, taken off its parent's self time", ""]
    print(lines[-2], flush=True)
    full, empty = build(args.depth, dtype, args.attn), build(0, dtype, args.attn)
    for pack_name in args.packs:
        lines += pack_report(args, pack_name, full, empty, cost_us)
    write_report(args.out, "profile_ops.py", argv, lines)


if __name__ == "__main__":
    main()
