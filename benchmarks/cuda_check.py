"""Check the CUDA paths of the encoder against its CPU float32 output.

Runs every attention backend that can run on the device (flash_attention_2 where
flash-attn is installed, sdpa, eager on small packs) in bf16 on mixed packs,
compares each with the same weights run on the CPU in float32, checks that
backward runs, and prints peak memory and time per call.

    python benchmarks/cuda_check.py --preset so400m --out outputs/cuda_check.json
    python benchmarks/cuda_check.py --device cpu --preset tiny   # smoke test without a GPU

MFU is model matmul FLOPs (attention included) over the measured bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from common import matmul_peak, model_flops

from moonvit import PRESETS, MoonViT
from moonvit.cli import device_name, output_file, positive_int
from moonvit.model.attention import flash_attn_installed

PACKS = {
    "448x448": [(32, 32)],
    "mixed-4": [(32, 32), (24, 40), (16, 16), (48, 36)],
    "32-small": [(16, 16)] * 32,
    "1792x1792": [(128, 128)],
    "mixed 16k": [(64, 64)] * 2 + [(32, 32)] * 6 + [(16, 16)] * 8,
}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/cuda_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="so400m", help="encoder preset (default: so400m)")
    parser.add_argument("--depth", type=positive_int, help="number of blocks (default: the preset's)")
    parser.add_argument(
        "--device", type=device_name, default="cuda", help="cuda, cuda:N, or cpu for a smoke test (default: cuda)"
    )
    parser.add_argument("--out", type=output_file, help="also write the report (JSON) here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    overrides = {} if args.depth is None else {"num_hidden_layers": args.depth}

    torch.manual_seed(0)
    reference_model = MoonViT.from_preset(args.preset, **overrides).eval()
    model = MoonViT.from_preset(args.preset, **overrides).eval()
    model.load_state_dict(reference_model.state_dict())
    model.to(device, torch.bfloat16)

    backends = ["sdpa", "eager"] + (["flash_attention_2"] if flash_attn_installed() and device.type == "cuda" else [])
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "flash_attn_installed": flash_attn_installed(),
        "preset": args.preset,
        "depth": model.config.num_hidden_layers,
        "bf16_matmul_peak_tflops": matmul_peak(torch.bfloat16, 8192 if device.type == "cuda" else 2048, 10, device)
        / 1e12,
        "results": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "results"}))
    for name, grids in PACKS.items():
        patches = sum(h * w for h, w in grids)
        pixels = torch.randn(patches, 3, 14, 14)
        with torch.no_grad():
            reference = reference_model(pixels, grids).last_hidden_state
        for backend in backends:
            if backend == "eager" and max(h * w for h, w in grids) > 4096:
                continue
            model.set_attn_implementation(backend)
            x = pixels.to(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with torch.no_grad():
                out, seconds = timed(lambda: model(x, grids).last_hidden_state, device)
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
            loss = model(x.requires_grad_(True), grids).last_hidden_state.float().square().mean()
            loss.backward()
            grad_ok = bool(torch.isfinite(x.grad).all())
            model.zero_grad(set_to_none=True)
            row = {
                "pack": name,
                "backend": backend,
                "patches": patches,
                "rel_error_vs_cpu_fp32": relative_error(out, reference),
                "ms_per_call": seconds * 1e3,
                "patches_per_s": patches / seconds,
                "mfu": model_flops(
                    grids, model.config.hidden_size, model.config.intermediate_size, model.config.num_hidden_layers
                )
                / seconds
                / (report["bf16_matmul_peak_tflops"] * 1e12),
                "peak_mib": peak,
                "backward_finite": grad_ok,
            }
            report["results"].append(row)
            print(json.dumps(row))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
