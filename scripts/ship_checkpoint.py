"""Assemble a shippable checkpoint folder from a training run and its linear probes.

    python scripts/ship_checkpoint.py --run runs/fm-sup --name fm-supervised \
        --title "supervised on Fashion-MNIST" --hardware "AMD EPYC (AVX-512 bf16), 2 threads" \
        --probe "Fashion-MNIST, mean=runs/probe-fm-sup" --probe "digits, mean=runs/probe-digits-sup"

Copies the run's checkpoint (config.json, model.safetensors, preprocessor_config.json), the
objective's files (a supervised head, an MAE decoder), its log (``train.log``, ``metrics.jsonl``)
and pictures into ``checkpoints/<name>/``, writes ``results.json`` (the training command and
figures, the test evaluation, each probe's test top-1 and command) and a model card
``README.md`` from them. Refuses a model file over 10 MB.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

MAX_MODEL_BYTES = 10 * 2**20


def probe_summary(folder: Path) -> dict[str, Any]:
    """The main view's and the raw-pixel baseline's test figures of one probe's results.json."""
    results = json.loads((folder / "results.json").read_text())
    runs = {run["features"]: run["test"] for run in results["runs"]}
    summary = {
        "features": results["features"],
        "top1": results["top1"],
        "mean_per_class_recall": results["mean_per_class_recall"],
        "command": results["command"],
        "minutes": round(results["timings"]["total_s"] / 60, 1),
    }
    if "pixels" in runs and results["features"] != "pixels":
        summary["pixels_top1"] = runs["pixels"]["top1"]
    return summary


def card(name: str, title: str, hardware: str, results: dict[str, Any], notes: str) -> str:
    train = results["train"]
    lines = [
        f"# {name}: {title}",
        "",
        f"A MoonViT encoder of {train['encoder']['shape']} ({train['encoder']['parameters'] / 1e6:.2f} M parameters),",
        f"trained by this package's `python -m moonvit_train` ({results['objective']} objective) on the train split of",
        "Fashion-MNIST (60,000 28x28 grayscale images, 10 classes; a stratified 10% held out for",
        "validation). The test split was never seen in training.",
        "",
        "```python",
        "from moonvit import MoonViT, MoonViTImageProcessor",
        "",
        f'encoder = MoonViT.from_pretrained("checkpoints/{name}")',
        f'processor = MoonViTImageProcessor.from_pretrained("checkpoints/{name}")',
        "```",
        "",
        "## How it was made",
        "",
        "```bash",
        results["command"],
        "```",
        "",
        f"- {train['steps']} steps, {train['epochs']:.1f} epochs, {train['images_seen']:,} images, "
        f"{train['minutes']:.1f} minutes of training on {hardware}",
        f"- {train['images_per_s']:.0f} images/s, {train['patches_per_s']:.0f} patches/s, "
        f"pack utilisation {train['utilisation']:.1%}; torch {results['versions']['torch']}",
        "- the log: [`train.log`](train.log) (validations and the test evaluation) and "
        "[`metrics.jsonl`](metrics.jsonl) (every step)",
        "",
        "## Results",
        "",
    ]
    test = results["test"]
    if "top1" in test:
        lines += [f"Its own head (`head.safetensors`) on the test split: top-1 **{test['top1']:.4f}**.", ""]
    elif "cosine" in test:
        lines += [
            f"Distilled from `{test['teacher']}`: on the test split, its patch tokens (through the adapter, "
            f"`distill_adapter.safetensors`) have a mean cosine of **{test['cosine']:.4f}** to the teacher's "
            f"standardised tokens (loss {test['distill_loss']:.4f}).",
            "",
        ]
    else:
        loss = f"Reconstruction error of the masked patches of the test split: {test['reconstruction_mse']:.4f}"
        lines += [f"{loss} (mean squared error per patch, {test['target']}; 1.0 is predicting the patch's mean).", ""]
    lines += [
        "Linear probes on the frozen encoder (`python -m moonvit_eval.linear_probe`, test top-1):",
        "",
        "| data | features | top-1 | raw pixels | command |",
        "|---|---|---|---|---|",
    ]
    for label, probe in results["probes"].items():
        pixels = f"{probe['pixels_top1']:.4f}" if "pixels_top1" in probe else "-"
        lines.append(f"| {label} | {probe['features']} | {probe['top1']:.4f} | {pixels} | `{probe['command']}` |")
    lines += ["", HOST_NOTE]
    if notes:
        lines += ["", notes.strip()]
    return "\n".join(lines) + "\n"


HOST_NOTE = """\
How much a figure moves between hosts: the same command on another CPU gives the features in other
last bits (oneDNN and MKL choose kernels by instruction set, AMX, AVX-512 or AVX2, and by matrix
shape), and the probe's grid search may then pick another setting where two score within a
validation image. Measured on `fm-supervised`'s digits probe: 0.9025 on an AMD EPYC (AVX-512) and on
an Intel Xeon with oneDNN, MKL and ATen held to AVX2, 0.8997 on the same Xeon with AVX-512 and on an Intel host
with AMX: one test image of 360 (lr 0.1 chosen on one, 0.3 on the other). Read a difference of a
test image or two (0.003-0.006 on digits, 0.0001-0.0002 on Fashion-MNIST's 10,000) as no difference."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="the training run's --out folder")
    parser.add_argument("--name", required=True, help="the folder name under checkpoints/")
    parser.add_argument("--title", required=True, help="the card's one-line description")
    parser.add_argument("--hardware", required=True, help="where it was trained, for the card")
    parser.add_argument("--probe", action="append", default=[], metavar="LABEL=DIR", help="a probe's output folder")
    parser.add_argument("--notes", default="", help="a closing paragraph for the card")
    parser.add_argument("--root", type=Path, default=Path("checkpoints"), help="where to write (default: checkpoints)")
    args = parser.parse_args(argv)

    run_results = json.loads((args.run / "results.json").read_text())
    model = args.run / "checkpoint" / "model.safetensors"
    if model.stat().st_size > MAX_MODEL_BYTES:
        parser.error(f"{model} is {model.stat().st_size / 2**20:.1f} MB, over the 10 MB limit")
    probes = {}
    for spec in args.probe:
        label, sep, folder = spec.rpartition("=")
        if not sep:
            parser.error(f"--probe {spec!r}: expected LABEL=DIR")
        probes[label] = probe_summary(Path(folder))

    out = args.root / args.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for file in sorted((args.run / "checkpoint").iterdir()):
        shutil.copy2(file, out / file.name)
    for file in (*run_results["files"][1:], "metrics.jsonl", "curves.png", "pictures.png"):
        if (args.run / file).is_file():
            shutil.copy2(args.run / file, out / file)
    shutil.copy2(args.run.with_suffix(".log"), out / "train.log")

    keys = ("steps", "images_seen", "epochs", "images_per_s", "patches_per_s", "mfu", "utilisation", "encoder")
    results = {
        "name": args.name,
        "objective": run_results["objective"],
        "command": run_results["command"],
        "train": {
            **{k: run_results[k] for k in keys},
            "minutes": run_results["train_minutes"],
            "hardware": args.hardware,
            "threads": run_results["threads"],
        },
        "test": {k: v for k, v in run_results["test"].items() if k != "confusion"},
        "probes": probes,
        "versions": run_results["versions"],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "README.md").write_text(card(args.name, args.title, args.hardware, results, args.notes))
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
