"""Check the CUDA paths of the encoder against its CPU float32 output, with pass / fail lines.

Runs every attention backend that can run on the device (flash_attention_2 where
flash-attn is installed, varlen where this torch has ``torch.nn.attention.varlen``, sdpa, flex on
CUDA, eager on small packs) in bf16 on mixed packs (64 images of 64 sizes among them), the 16k
packs (one 1792x1792 image, a mixed 16k pack) and a K2.5 video pack, and checks:

- accuracy: each backend within 2e-2 relative (L2) of the same weights run on the CPU in float32;
- backward: a loss's gradient with respect to the pixels is finite;
- memory: the peak a forward adds grows linearly with the patches (packs of 8, 32 and 128
  16x16 images: per-patch peak within 2x of the smallest pack's), far under one L x L matrix;
- speed: MFU (model matmul FLOPs, attention included, over the measured bf16 matmul peak)
  of at least 45% at 1792x1792 with flash-attn's varlen kernel and 50% with torch's (``varlen``);
  every backend's MFU at 1792x1792 is printed beside it, and flex's first call (its compile
  included) is reported;
- varlen against sdpa, forward time per pack: at least 1.5x sdpa's speed on the 64 mixed images
  (where sdpa makes one call per size), and nowhere slower than sdpa beyond 5% (a table of
  milliseconds per backend and pack is printed at the end);
- LocateAnything-3B's images (448x448, 1024x768 stretched to 56 x 74 patches, and one at its
  25,600-patch limit): this package (``auto``) faster than the stock remote code without
  flash-attn (one SDPA call under a dense (S, S) block mask, see ``bench_locateanything.py``),
  with the seconds, the peak memory (an out-of-memory error recorded as such) and the two
  outputs' relative difference.

    python benchmarks/cuda_check.py --out outputs/cuda_check.json        # the real so400m tower
    python benchmarks/cuda_check.py --packs "mixed 64" 1792x1792 --no-memory --no-locateanything  # speed only
    python benchmarks/cuda_check.py --device cpu --preset tiny --no-speed  # a smoke run without a GPU

Exit status 1 when a check fails. ``tests/test_cuda.py`` holds the same checks at small
sizes as pytest tests (``pytest -m cuda``; skipped without a GPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from bench_locateanything import SIZES as LOCATEANYTHING_SIZES
from bench_locateanything import STOCK, locateanything_grid, stock_sdpa_attention
from common import as_thw, matmul_peak, model_flops, relative_error

from moonvit import PRESETS, MoonViT
from moonvit.cli import device_name, output_file, positive_int
from moonvit.model.attention import (
    AttentionUnavailableError,
    flash_attn_installed,
    register_attention,
    resolve_attn_implementation,
)
from moonvit.model.flex import first_call_seconds, flex_unavailable

MIXED_64 = [(8 + 2 * (i % 16), 8 + 6 * (i // 16)) for i in range(64)]
"""64 images of 64 sizes, 8-38 x 8-26 patches (112-532 x 112-364 pixels; 64 to 988 patches, 25,024 in
all): native-resolution images as they come, where sdpa makes one call per size."""
PACKS: dict[str, list[tuple[int, ...]]] = {
    "448x448": [(32, 32)],
    "mixed-4": [(32, 32), (24, 40), (16, 16), (48, 36)],
    "32-small": [(16, 16)] * 32,
    "mixed 64": MIXED_64,
    "1792x1792": [(128, 128)],
    "mixed 16k": [(64, 64)] * 2 + [(32, 32)] * 6 + [(16, 16)] * 8,
    "video 4 x 4-frame 448x448": [(4, 32, 32)] * 4,
}
MAX_RELATIVE_ERROR = 2e-2
MIN_FLASH_MFU_1792 = 0.45
MIN_VARLEN_MFU_1792 = 0.50
MIN_VARLEN_SPEEDUP_MIXED_64 = 1.5
MAX_VARLEN_SLOWDOWN = 1.05
"""varlen may take at most this many times sdpa's time on a pack (timing noise), never more."""
MEMORY_COUNTS = (8, 32, 128)
EAGER_MAX_SQUARES = 2 * 4096**2


def timed(fn, device: torch.device, repeats: int = 3) -> tuple[object, float]:
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - start) / repeats


def forward_peak_mib(model: MoonViT, pixels: torch.Tensor, grids: torch.Tensor, device: torch.device) -> float:
    """Peak CUDA memory one no-grad forward adds above what is allocated before it (NaN off CUDA)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        model(pixels, grids)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def locateanything_rows(report: dict, model: MoonViT, device: torch.device) -> None:
    """LocateAnything-3B's three image sizes through ``model`` (bf16, on ``device``): ``auto``
    against the stock dense-mask SDPA, one image a call; a pass line where ours is faster."""
    register_attention(STOCK, stock_sdpa_attention)
    for width, height in LOCATEANYTHING_SIZES.values():
        rows, cols = locateanything_grid(width, height)
        grids = torch.tensor([[rows, cols]])
        pixels = torch.randn(rows * cols, 3, 14, 14, device=device, dtype=torch.bfloat16)
        row: dict = {"size": f"{width}x{height}", "grid": [rows, cols], "patches": rows * cols}
        outputs = {}
        for name, backend in (("ours", "auto"), ("stock", STOCK)):
            model.set_attn_implementation(backend)
            try:
                row[f"{name}_peak_mib"] = forward_peak_mib(model, pixels, grids, device)
                with torch.no_grad():
                    outputs[name], seconds = timed(lambda: model(pixels, grids).merged, device)
                row[f"{name}_ms"] = seconds * 1e3
            except torch.OutOfMemoryError as error:
                row[f"{name}_peak_mib"], row[f"{name}_ms"] = "out of memory", None
                row[f"{name}_error"] = str(error).split("\n")[0]
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if len(outputs) == 2:
            row["rel_diff"] = relative_error(outputs["ours"], outputs["stock"])
        report.setdefault("locateanything", []).append(row)
        print(json.dumps(row), flush=True)
        faster = row["stock_ms"] is None or row["ours_ms"] < row["stock_ms"]
        stock = "out of memory" if row["stock_ms"] is None else f"{row['stock_ms']:.1f} ms"
        check(report, f"LocateAnything {row['size']} ({rows}x{cols})", faster,
              f"ours {row['ours_ms']:.1f} ms, {row['ours_peak_mib']:.0f} MiB; stock {stock}")  # fmt: skip
    model.set_attn_implementation("auto")


def varlen_speed_checks(report: dict) -> None:
    """varlen's forward time against sdpa's on each pack: at least 1.5x on the 64 mixed images, and
    nowhere slower beyond noise."""
    ms = {(row["pack"], row["backend"]): row["ms_per_call"] for row in report["results"]}
    for pack in dict.fromkeys(row["pack"] for row in report["results"]):
        if (pack, "varlen") not in ms or (pack, "sdpa") not in ms:
            continue
        speedup = ms[pack, "sdpa"] / ms[pack, "varlen"]
        detail = f"{ms[pack, 'varlen']:.1f} ms against sdpa's {ms[pack, 'sdpa']:.1f} ms: {speedup:.2f}x"
        if pack == "mixed 64":
            check(report, f"speed varlen {pack}", speedup >= MIN_VARLEN_SPEEDUP_MIXED_64,
                  f"{detail} (at least {MIN_VARLEN_SPEEDUP_MIXED_64}x)")  # fmt: skip
        else:
            check(report, f"speed varlen {pack}", speedup >= 1 / MAX_VARLEN_SLOWDOWN,
                  f"{detail} (no slower than sdpa beyond {MAX_VARLEN_SLOWDOWN - 1:.0%})")  # fmt: skip


def print_speed_table(report: dict, backends: list[str]) -> None:
    """Forward milliseconds and MFU per pack (rows) and backend (columns), as markdown."""
    cells = {(row["pack"], row["backend"]): row for row in report["results"]}
    packs = list(dict.fromkeys(row["pack"] for row in report["results"]))
    lines = [
        "| pack | patches | " + " | ".join(f"{b} ms | {b} MFU" for b in backends) + " |",
        "|---|---|" + "---|---|" * len(backends),
    ]
    for pack in packs:
        row = [pack, str(next(r["patches"] for (p, _), r in cells.items() if p == pack))]
        for backend in backends:
            cell = cells.get((pack, backend))
            row += ["-", "-"] if cell is None else [f"{cell['ms_per_call']:.1f}", f"{cell['mfu']:.0%}"]
        lines.append("| " + " | ".join(row) + " |")
    print("\n".join(lines), flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/cuda_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="so400m", help="encoder size (default: so400m)")
    parser.add_argument("--depth", type=positive_int, help="number of blocks (default: the preset's)")
    parser.add_argument(
        "--device", type=device_name, default="cuda", help="cuda, cuda:N, or cpu for a smoke test (default: cuda)"
    )
    parser.add_argument(
        "--no-speed", action="store_true", help="skip the MFU and varlen speed checks (smoke runs, small presets)"
    )
    parser.add_argument(
        "--packs", nargs="+", choices=list(PACKS), default=list(PACKS), metavar="PACK",
        help=f"packs to run (default: all): {', '.join(repr(p) for p in PACKS)}",
    )  # fmt: skip
    parser.add_argument("--no-memory", action="store_true", help="skip the memory-scaling check")
    parser.add_argument(
        "--no-locateanything", action="store_true", help="skip LocateAnything-3B's images against the stock code"
    )
    parser.add_argument("--out", type=output_file, help="also write the report (JSON) here")
    return parser


def check(report: dict, name: str, passed: bool, detail: str) -> None:
    """Record and print one pass / fail line."""
    report["checks"].append({"check": name, "passed": passed, "detail": detail})
    print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    overrides = {"init_pos_emb_time": 4, **({} if args.depth is None else {"num_hidden_layers": args.depth})}

    torch.manual_seed(0)
    reference_model = MoonViT.from_preset(args.preset, **overrides).eval()
    model = MoonViT.from_preset(args.preset, **overrides).eval()
    model.load_state_dict(reference_model.state_dict())
    model.to(device, torch.bfloat16)
    config = model.config

    backends = ["sdpa", "eager"] + (["flash_attention_2"] if flash_attn_installed() and device.type == "cuda" else [])
    try:
        backends.append(resolve_attn_implementation("varlen", device, torch.bfloat16))
        varlen_reason = None
    except AttentionUnavailableError as error:
        varlen_reason = str(error)
    if device.type == "cuda" and flex_unavailable(device, torch.bfloat16) is None:
        backends.append("flex")  # CPU flex has no backward; the CPU tests cover its forward
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "flash_attn_installed": flash_attn_installed(),
        "varlen_unavailable": varlen_reason,
        "auto": resolve_attn_implementation("auto", device, torch.bfloat16),
        "preset": args.preset,
        "depth": config.num_hidden_layers,
        "bf16_matmul_peak_tflops": matmul_peak(torch.bfloat16, 8192 if device.type == "cuda" else 2048, 10, device)
        / 1e12,
        "results": [],
        "checks": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k not in ("results", "checks")}))
    for name in args.packs:
        grid_list = PACKS[name]
        grids = as_thw(grid_list)
        patches = int(grids.prod(dim=1).sum())
        pixels = torch.randn(patches, 3, 14, 14)
        with torch.no_grad():
            reference = reference_model(pixels, grids).last_hidden_state
        for backend in backends:
            # eager keeps every block's (heads, n, n) scores for the backward: two 4096-patch items at most
            if backend == "eager" and int(grids.prod(dim=1).square().sum()) > EAGER_MAX_SQUARES:
                continue
            model.set_attn_implementation(backend)
            x = pixels.to(device)
            peak = forward_peak_mib(model, x, grids, device)
            with torch.no_grad():
                out, seconds = timed(lambda: model(x, grids).last_hidden_state, device)
            loss = model(x.requires_grad_(True), grids).last_hidden_state.float().square().mean()
            loss.backward()
            grad_ok = bool(torch.isfinite(x.grad).all())
            model.zero_grad(set_to_none=True)
            flops = model_flops(grid_list, config)
            row = {
                "pack": name,
                "backend": backend,
                "patches": patches,
                "rel_error_vs_cpu_fp32": relative_error(out, reference),
                "ms_per_call": seconds * 1e3,
                "patches_per_s": patches / seconds,
                "mfu": flops / seconds / (report["bf16_matmul_peak_tflops"] * 1e12),
                "peak_mib": peak,
                "backward_finite": grad_ok,
            }
            report["results"].append(row)
            print(json.dumps(row))
            error = row["rel_error_vs_cpu_fp32"]
            check(report, f"accuracy {backend} {name}", error <= MAX_RELATIVE_ERROR,
                  f"{error:.2e} relative to CPU fp32 (limit {MAX_RELATIVE_ERROR})")  # fmt: skip
            check(report, f"backward {backend} {name}", grad_ok, "finite pixel gradients" if grad_ok else "non-finite")
            if name == "1792x1792" and backend == "flash_attention_2" and not args.no_speed:
                check(report, "MFU flash 1792x1792", row["mfu"] >= MIN_FLASH_MFU_1792,
                      f"{row['mfu']:.0%} (at least {MIN_FLASH_MFU_1792:.0%})")  # fmt: skip
            if name == "1792x1792" and backend == "varlen" and not args.no_speed:
                check(report, "MFU varlen 1792x1792", row["mfu"] >= MIN_VARLEN_MFU_1792,
                      f"{row['mfu']:.0%} (at least {MIN_VARLEN_MFU_1792:.0%})")  # fmt: skip
    at_1792 = {row["backend"]: row["mfu"] for row in report["results"] if row["pack"] == "1792x1792"}
    print("MFU at 1792x1792: " + ", ".join(f"{backend} {mfu:.0%}" for backend, mfu in at_1792.items()))
    if "varlen" in backends and not args.no_speed:
        varlen_speed_checks(report)
    print_speed_table(report, backends)
    report["flex_first_call_s"] = {str(key[:4]): s for key, s in first_call_seconds().items()}
    if report["flex_first_call_s"]:
        print(f"flex first calls (compile included): {report['flex_first_call_s']}")
    if device.type == "cuda" and not args.no_memory:
        model.set_attn_implementation("auto")
        peaks = {}
        for count in MEMORY_COUNTS:
            grids = torch.tensor([(16, 16)] * count)
            peaks[count] = forward_peak_mib(model, torch.randn(count * 256, 3, 14, 14, device=device), grids, device)
        per_patch = {count: peak / (count * 256) for count, peak in peaks.items()}
        square = (MEMORY_COUNTS[-1] * 256) ** 2 * 2 / 2**20
        linear = max(per_patch.values()) <= 2 * per_patch[MEMORY_COUNTS[0]] and peaks[MEMORY_COUNTS[-1]] < square
        report["memory_mib"] = peaks
        check(report, "memory linear in patches", linear,
              ", ".join(f"{c} x 256: {p:.0f} MiB" for c, p in peaks.items())
              + f"; one (L, L) bf16 matrix at the largest: {square:.0f} MiB")  # fmt: skip
    if args.preset.startswith("so400m") and not args.no_locateanything:  # LocateAnything's tower is so400m
        locateanything_rows(report, model, device)
    failed = [c["check"] for c in report["checks"] if not c["passed"]]
    print(f"{len(report['checks']) - len(failed)} of {len(report['checks'])} checks passed" +
          (f"; failed: {', '.join(failed)}" if failed else ""))  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
