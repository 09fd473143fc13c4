"""Training-step throughput of the trainer's real path (render, forward, backward, AdamW), side by side.

    python benchmarks/bench_train.py --threads 2

Sections, each measured within this one run:
1. images/s and MFU (training FLOPs = 3 x forward) for tiny / small at 16 and 64 patches per
   image (Fashion-MNIST at 56 / 112 px), bf16 autocast and fp32;
2. token dropping: images/s at --token-drop 0.5 against none, at the same patch budget;
3. packed against padded: the packed step (forward + backward) against a dense (B, N, D) batch of
   the same images padded to the longest, with a key-padding mask (uniform and mixed sizes);
4. packing utilisation on the datasets' size distributions;
5. MAE: the encoder's step (forward + backward) on the visible 25% of the same images against all
   of them, and the whole MAE step (encoder + decoder + AdamW) against the supervised step;
6. gradient checkpointing (``--grad-checkpointing``): the peak memory a training step adds and its
   time, with and without, on the same model and pack.

Writes benchmarks/results/bench_train.txt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from common import host_line, matmul_peak, mib, peak_extra_bytes

from moonvit import MoonViT, MoonViTImageProcessor, pool_features, preset_config
from moonvit.cli import add_threads_argument, apply_threads, output_file, positive_int
from moonvit.model.rope import apply_rope
from moonvit.perf import config_flops
from moonvit_eval.datasets import load_dataset
from moonvit_train.augment import AugmentConfig
from moonvit_train.batch import ImageSource, render_pack
from moonvit_train.objectives import MAEObjective, SupervisedObjective
from moonvit_train.optim import OptimConfig, build_optimizer, param_groups
from moonvit_train.plan import ImageStream, Packer, PlannedTrainImage, Resolution, TokenDrop, default_lookahead

RESULTS = Path(__file__).parent / "results" / "bench_train.txt"
BUDGET = 4096


def step_timer(model: MoonViT, source: ImageSource, side: tuple[int, int], drop: TokenDrop, dtype: torch.dtype):
    """A closure running one real training step; returns (seconds, images, forward FLOPs)."""
    head = SupervisedObjective(model.config.hidden_size, [str(i) for i in range(10)])
    config = OptimConfig(1e-3, 1e-3, 0.05, 1.0)
    optimizer = build_optimizer(param_groups(model, head, config), config, torch.device("cpu"))
    resolution = Resolution(*side, max_patches=BUDGET)
    stream = ImageStream(source.sizes(), resolution, drop, seed=0)
    packer = Packer(stream, BUDGET, default_lookahead(BUDGET, 16))
    augment = AugmentConfig()
    c = model.config

    def run() -> tuple[float, int, float]:
        start = time.perf_counter()
        pack = packer.next_pack(0.0)
        batch = render_pack(pack, source, c, augment, np.random.default_rng(0))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = head(model, batch).loss_sum / len(pack)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        flops = config_flops([i.kept for i in pack], c)
        return time.perf_counter() - start, len(pack), flops

    return run


def measure(run, repeats: int) -> tuple[float, float]:
    """(images/s, training FLOP/s) at the median step after a warm-up step."""
    run()
    samples = [run() for _ in range(repeats)]
    seconds, images, flops = (statistics.median(column) for column in zip(*samples))
    return images / seconds, 3 * flops / seconds


def dense_step(model: MoonViT, batch, dtype: torch.dtype) -> None:
    """Forward + backward of the same images as a padded (B, N, D) batch with a key-padding mask."""
    grid = batch.grid
    lengths = torch.tensor(grid.seqlens)
    count, longest = len(lengths), int(lengths.max())
    valid = torch.arange(longest)[None] < lengths[:, None]  # (B, N)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        x = model.patch_embed(batch.pixel_values, grid)
        dense = x.new_zeros(count, longest, x.shape[1]).masked_scatter(valid[..., None], x)
        rotation = torch.zeros(count, longest, *grid.rope_rotation.shape[1:], dtype=grid.rope_rotation.dtype)
        rotation[..., 0] = 1.0  # padding rows: the identity rotation (cos 1, sin 0)
        rotation[valid] = grid.rope_rotation
        rotation = rotation.flatten(0, 1)
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        for block in model.encoder.blocks:
            q, k, v = block.wqkv(block.norm0(dense)).unflatten(-1, (3, block.num_heads, -1)).unbind(2)
            q, k = (apply_rope(t.flatten(0, 1), rotation).unflatten(0, (count, longest)) for t in (q, k))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
            dense = dense + block.wo(out.transpose(1, 2).flatten(2))
            dense = dense + block.mlp(block.norm1(dense))
        dense = model.encoder.final_layernorm(dense)
        pooled = (dense * valid[..., None]).sum(1) / lengths[:, None]
    pooled.float().sum().backward()


def packed_step(model: MoonViT, batch, dtype: torch.dtype) -> None:
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model(batch.pixel_values, grid=batch.grid).last_hidden_state
    pool_features(out, batch.grid).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_threads_argument(parser)
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed steps per figure (median)")
    parser.add_argument("--out", type=output_file, default=RESULTS, help=f"the results file (default: {RESULTS})")
    parser.add_argument(
        "--sections",
        type=positive_int,
        nargs="+",
        default=[1, 2, 3, 4, 5, 6],
        help="the sections to run (default: all six; see the module docstring)",
    )
    args = parser.parse_args()
    threads = apply_threads(args.threads)
    torch.manual_seed(0)
    dataset = load_dataset("fashion-mnist")
    source = ImageSource(dataset.train, MoonViTImageProcessor())
    lines = [f"# {' '.join(['python benchmarks/bench_train.py', *sys.argv[1:]])}", f"host: {host_line()}"]
    lines.append(f"threads: {threads}; torch {torch.__version__}; pack budget {BUDGET} patches")
    peaks = {name: matmul_peak(dtype, 2048) for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    lines.append("matmul peak GFLOP/s: " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks.items()))

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for line in lines:
        print(line)
    if 1 in args.sections:
        emit("\n## 1. training throughput (render + forward + backward + fused AdamW)")
        emit("| preset | patches/image | dtype | images/s | patches/s | MFU |")
        emit("|---|---|---|---|---|---|")
        for preset in ("tiny", "small"):
            for side, patches in ((56, 16), (112, 64)):
                for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                    model = MoonViT(preset_config(preset, drop_path_rate=0.05)).train()
                    run = step_timer(model, source, (side, side), TokenDrop(), dtype)
                    images, flops = measure(run, args.repeats)
                    mfu = flops / peaks[name]
                    emit(f"| {preset} | {patches} | {name} | {images:.0f} | {images * patches:.0f} | {mfu:.1%} |")

    if 2 in args.sections:
        emit("\n## 2. token dropping, same patch budget (small, 56-112 px, bf16)")
        emit("| token drop | images/s | ratio |")
        emit("|---|---|---|")
        rates = {}
        for rate in (0.0, 0.5):
            model = MoonViT(preset_config("small")).train()
            run = step_timer(model, source, (56, 112), TokenDrop(rate, rate), torch.bfloat16)
            rates[rate] = measure(run, args.repeats)[0]
            emit(f"| {rate} | {rates[rate]:.0f} | {rates[rate] / rates[0.0]:.2f}x |")

    if 3 in args.sections:
        emit("\n## 3. packed step against a padded dense batch of the same images (forward + backward)")
        emit("| images | dtype | padding | packed ms | dense ms | packed speed / dense |")
        emit("|---|---|---|---|---|---|")
        model = MoonViT(preset_config("small")).train()
        for label, side in (("uniform 56 px", (56, 56)), ("mixed 56-112 px", (56, 112))):
            stream = ImageStream(source.sizes(), Resolution(*side, max_patches=BUDGET), TokenDrop(), seed=1)
            pack = Packer(stream, BUDGET, default_lookahead(BUDGET, 16)).next_pack(0.0)
            batch = render_pack(pack, source, model.config, None)
            padding = 1 - sum(batch.grid.seqlens) / (len(pack) * max(batch.grid.seqlens))
            for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                times = {}
                for kind, step in (("packed", packed_step), ("dense", dense_step)):
                    step(model, batch, dtype)
                    samples = []
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        step(model, batch, dtype)
                        samples.append(time.perf_counter() - start)
                        model.zero_grad(set_to_none=True)
                    times[kind] = statistics.median(samples)
                speed = times["dense"] / times["packed"]
                emit(
                    f"| {label} | {name} | {padding:.0%} | {times['packed'] * 1e3:.0f} | {times['dense'] * 1e3:.0f} | "
                    f"{speed:.2f}x |"
                )

    if 4 in args.sections:
        emit("\n## 4. packing utilisation (kept patches / budget, 200 packs)")
        emit("| dataset | resolution | token drop | utilisation |")
        emit("|---|---|---|---|")
        digits = ImageSource(load_dataset("digits").train, MoonViTImageProcessor())
        aspect = np.random.default_rng(0).uniform(0.5, 2.0, 5000)
        folder_like = np.stack([np.full(5000, 300), (300 * aspect).astype(np.int64)], 1)
        for label, sizes, side in (
            ("fashion-mnist", source.sizes(), (56, 112)),
            ("digits", digits.sizes(), (28, 56)),
            ("folder-like, aspect 1:2-2:1", folder_like, (112, 336)),
        ):
            for drop in (TokenDrop(), TokenDrop(0.5, 0.5), TokenDrop(0.6, 0.2)):
                stream = ImageStream(sizes, Resolution(*side, max_patches=BUDGET), drop, seed=0)
                packer = Packer(stream, BUDGET, default_lookahead(BUDGET, 40))
                used = [sum(i.kept for i in packer.next_pack(k / 200)) for k in range(200)]
                emit(f"| {label} | {side[0]}-{side[1]} px | {drop} | {np.mean(used) / BUDGET:.2%} |")

    if 5 in args.sections:
        emit("\n## 5. MAE at 75% masking (small, 112 px = 64 patches per image, bf16): the same images")
        emit("| step | images | ms | speed-up |")
        emit("|---|---|---|---|")
        for row in mae_rows(source, args.repeats):
            emit(row)

    if 6 in args.sections:
        emit("\n## 6. gradient checkpointing: a training step's peak memory and time, with and without")
        emit("| model | images x patches | dtype | peak MiB without | peak MiB with | saved | time with / without |")
        emit("|---|---|---|---|---|---|---|")
        for row in checkpointing_rows(source, args.repeats):
            emit(row)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


def checkpointing_rows(source: ImageSource, repeats: int) -> list[str]:
    """The extra resident memory at the peak of one forward + backward (Linux), and its median time,
    without and with gradient checkpointing, on one pack of 112 px images (64 patches each)."""
    rows = []
    for label, config in (
        ("small (6 x 384)", preset_config("small")),
        ("so400m width, 6 blocks", preset_config("so400m", num_hidden_layers=6)),
    ):
        torch.manual_seed(0)
        model = MoonViT(config).train()
        items = [PlannedTrainImage(i, 8, 8, 64, 2000 + i) for i in range(BUDGET // 64)]
        batch = render_pack(items, source, model.config, None)
        dtype = torch.bfloat16
        figures = {}
        for enabled in (False, True):
            if enabled:
                model.gradient_checkpointing_enable()
            else:
                model.gradient_checkpointing_disable()

            def step() -> None:
                packed_step(model, batch, dtype)
                model.zero_grad(set_to_none=True)

            step()
            peak = peak_extra_bytes(step)
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                samples.append(time.perf_counter() - start)
            figures[enabled] = (peak, statistics.median(samples))
        (without, t0), (with_, t1) = figures[False], figures[True]
        saved = "n/a" if without is None or with_ is None else f"{1 - with_ / without:.0%}"
        rows.append(
            f"| {label} | {len(items)} x 64 | bf16 | {mib(without)} | {mib(with_)} | {saved} | {t1 / t0:.2f}x |"
        )
    return rows


def mae_rows(source: ImageSource, repeats: int) -> list[str]:
    """Median times of the encoder step on whole images against the visible 25%, and of the whole
    MAE step (decoder 2 x 128 and AdamW included) against the supervised step, on one set of images."""
    torch.manual_seed(0)
    model = MoonViT(preset_config("small")).train()
    config = model.config
    images = BUDGET // 64
    whole = [PlannedTrainImage(i, 8, 8, 64, 1000 + i) for i in range(images)]
    masked = [PlannedTrainImage(i, 8, 8, TokenDrop(0.75, 0.75).kept(64, 0.0), 1000 + i) for i in range(images)]
    full_batch = render_pack(whole, source, config, None)
    mae_batch = render_pack(masked, source, config, None, full_pixels=True)
    mae = MAEObjective(config, 0.75)
    head = SupervisedObjective(config.hidden_size, [str(i) for i in range(10)])
    optim = OptimConfig(1e-3, 1e-3, 0.05, 1.0)
    mae_opt = build_optimizer(param_groups(model, mae, optim), optim, torch.device("cpu"))
    sup_opt = build_optimizer(param_groups(model, head, optim), optim, torch.device("cpu"))

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        return statistics.median(samples)

    def whole_step(optimizer=None, objective=None, batch=full_batch):
        def run() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if objective is None:
                    loss = pool_features(model(batch.pixel_values, grid=batch.grid).last_hidden_state, batch.grid).sum()
                else:
                    loss = objective(model, batch).loss_sum
            loss.float().backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        return run

    encoder_full = timed(whole_step())
    encoder_masked = timed(whole_step(batch=mae_batch))
    supervised = timed(whole_step(sup_opt, head))
    mae_step = timed(whole_step(mae_opt, mae, mae_batch))
    return [
        f"| encoder, every patch | {images} | {encoder_full * 1e3:.0f} | 1.00x |",
        f"| encoder, visible 25% | {images} | {encoder_masked * 1e3:.0f} | {encoder_full / encoder_masked:.2f}x |",
        f"| supervised step (head, AdamW) | {images} | {supervised * 1e3:.0f} | 1.00x |",
        f"| MAE step (decoder 2 x 128, AdamW) | {images} | {mae_step * 1e3:.0f} | {supervised / mae_step:.2f}x |",
    ]


if __name__ == "__main__":
    main()
