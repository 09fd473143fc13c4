"""The trainer as a multi-GPU user runs it: collectives on the backend they run on, gradient
checkpointing, FSDP2 resumed at another world size, --minutes resumed with its calibration, the
objectives' defaults, and MAE on a folder of unlabelled images."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from test_train import REPO, descendants, free_port, run_ranks, train, weights

from moonvit.distributed import Ranks, process_group_backend
from moonvit_train.config import parse_args

TINY = ["--preset", "tiny", "--dataset", "digits", "--threads", "1", "--no-progress", "--resolution", "28"]
SUPERVISED = ["--objective", "supervised", *TINY, "--batch-patches", "1024", "--evals", "1", "--hflip", "0"]


def torchrun(ranks: int, args: list, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
            str(free_port()), "-m", "moonvit_train", *map(str, args), "--out", str(out)]  # fmt: skip


def kill_after(command: list[str], out: Path, steps: int) -> None:
    """Start ``command`` and SIGKILL it and every process below it once ``steps`` training steps are
    logged in ``out`` (or after 120 s, or when it ends by itself)."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if log.is_file() and log.read_text().count('"train"') >= steps:
            break
        time.sleep(0.02)
    for pid in [*descendants(process.pid), process.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


# ---- collectives ----------------------------------------------------------------------------------


def test_the_process_group_takes_cpu_tensors_on_gpus_too():
    """NCCL alone refuses CPU tensors, and the trainer reduces its statistics on the host: on CUDA the
    group is gloo for CPU tensors and NCCL for CUDA ones."""
    assert process_group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_every_tensor_the_trainer_reduces_is_on_the_host(tmp_path, monkeypatch):
    """What the mixed group sends through gloo: each statistic the engine reduces (step sums,
    evaluation sums, the --minutes calibration) is a CPU tensor."""
    seen: list[torch.device] = []
    for name in ("sum", "max"):
        original = getattr(Ranks, name)

        def spy(self, tensor, _original=original):
            seen.append(tensor.device)
            return _original(self, tensor)

        monkeypatch.setattr(Ranks, name, spy)
    train(*SUPERVISED, "--minutes", "0.05", "--out", tmp_path)
    assert len(seen) > 5 and all(device.type == "cpu" for device in seen)


# ---- gradient checkpointing -------------------------------------------------------------------------


def test_gradient_checkpointing_is_wired_and_changes_no_result(tmp_path, monkeypatch):
    """With --grad-checkpointing every training forward of a block runs twice (again in backward;
    evaluation forwards run without gradients, once), and the run's weights are the plain run's."""
    import moonvit.model.blocks as blocks

    original = blocks.Block.forward
    with_grad = {"n": 0}

    def counted(self, *inputs, **kwargs):
        with_grad["n"] += torch.is_grad_enabled()
        return original(self, *inputs, **kwargs)

    monkeypatch.setattr(blocks.Block, "forward", counted)
    args = [*SUPERVISED, "--steps", "3", "--dtype", "fp32", "--drop-path", "0.1"]
    plain = train(*args, "--out", tmp_path / "plain")
    plain_forwards, with_grad["n"] = with_grad["n"], 0
    checkpointed = train(*args, "--grad-checkpointing", "--out", tmp_path / "checkpointed")
    assert plain_forwards == 3 * 2 and with_grad["n"] == 2 * plain_forwards  # 3 steps x 2 blocks, then recomputed
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "checkpointed")
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)  # the same steps, recomputed
    assert checkpointed["args"]["grad_checkpointing"] == "True" and plain["args"]["grad_checkpointing"] == "False"


def test_the_encoder_is_built_with_checkpointing_when_asked():
    from moonvit_train.build import build_encoder

    config = parse_args(["--objective", "supervised", *TINY, "--steps", "1", "--out", "x", "--grad-checkpointing"])
    encoder, _ = build_encoder(config)
    assert encoder.encoder.gradient_checkpointing


# ---- resume ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then"), [(1, 2), (2, 1)], ids=["1 rank, then 2", "2 ranks, then 1"])
def test_fsdp2_resumes_at_another_world_size(tmp_path, first, then):
    """The state holds the optimizer by parameter name (the distributed state-dict API in every
    case): a run saved at one world size resumes at another and ends as an uninterrupted run of
    one process does, to the float error FSDP's reductions add (fp32)."""
    args = [*SUPERVISED, "--steps", "12", "--save-every", "2", "--packs-per-step", "2", "--dtype", "fp32", "--fsdp"]
    train(*args, "--out", tmp_path / "straight")
    out = tmp_path / "switched"
    alone = [sys.executable, "-m", "moonvit_train", *map(str, args), "--out", str(out)]
    kill_after(torchrun(2, args, out) if first == 2 else alone, out, 3)  # the state of step 2 is written
    assert not (out / "results.json").exists() and (out / "state" / "last.pt").is_file()
    command = torchrun(2, args, out) if then == 2 else alone
    result = run_ranks(command)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    resumed = re.search(rf"resuming .* at step (\d+) of 12 \({then} ranks\)", result.stdout)
    assert resumed and 2 <= int(resumed.group(1)) < 12, result.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 12 and results["world_size"] == then
    one, switched = weights(tmp_path / "straight"), weights(out)
    assert max(float((one[k] - switched[k]).norm() / one[k].norm()) for k in one) <= 1e-5


def test_a_minutes_run_keeps_its_calibration_when_resumed(tmp_path):
    args = [*SUPERVISED, "--minutes", "0.2", "--save-every", "2"]
    command = [sys.executable, "-m", "moonvit_train", *map(str, args), "--out", str(tmp_path)]
    kill_after(command, tmp_path, 3)
    assert (tmp_path / "state" / "last.pt").is_file() and not (tmp_path / "results.json").exists()
    saved = torch.load(tmp_path / "state" / "last.pt", weights_only=False)
    results = train(*args, "--out", tmp_path)
    assert results["calibration"] == saved["calibration"] and set(results["calibration"]) == {"step_s", "val_s"}


# ---- the objectives' defaults ------------------------------------------------------------------------


def test_each_objective_has_its_own_betas_and_stochastic_depth():
    supervised = parse_args(["--objective", "supervised", *TINY, "--steps", "1", "--out", "x"])
    mae = parse_args(["--objective", "mae", *TINY, "--steps", "1", "--out", "x"])
    assert (supervised.optim.betas, supervised.model.drop_path) == ((0.9, 0.999), 0.05)
    assert (mae.optim.betas, mae.model.drop_path) == ((0.9, 0.95), 0.0)  # MAE's recipe
    given = parse_args(["--objective", "mae", *TINY, "--steps", "1", "--out", "x", "--betas", "0.8", "0.9"])
    assert given.optim.betas == (0.8, 0.9)
    deeper = parse_args(["--objective", "mae", *TINY, "--steps", "1", "--out", "x", "--drop-path", "0.1"])
    assert deeper.model.drop_path == 0.1


def test_the_seed_also_draws_the_head_of_a_checkpoint_run(tmp_path):
    from moonvit import MoonViT, preset_config

    MoonViT(preset_config("tiny")).save_pretrained(tmp_path / "tower")
    base = ["--objective", "supervised", "--checkpoint", tmp_path / "tower", *TINY[2:], "--evals", "0"]
    base += ["--batch-patches", "1024", "--steps", "1", "--lr", "1e-9", "--head-lr", "1e-9"]
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        train(*base, "--seed", seed, "--out", tmp_path / name)
    heads = {name: load_file(tmp_path / name / "head.safetensors")["head.weight"] for name in "abc"}
    assert torch.equal(heads["a"], heads["b"]) and not torch.allclose(heads["a"], heads["c"])


# ---- unlabelled data --------------------------------------------------------------------------------


def test_mae_pretrains_on_a_folder_of_unlabelled_images_then_probes_a_labelled_set(tmp_path):
    """images:DIR: every image below DIR, any sizes, no labels; no test split, so the validation
    part is what the run reports; --probe-dataset names the labelled set of the probe at the end."""
    rng = np.random.default_rng(0)
    for i in range(24):
        folder = tmp_path / "raw" / ("a" if i % 2 else "a/b/c")
        folder.mkdir(parents=True, exist_ok=True)
        size = (int(rng.integers(20, 90)), int(rng.integers(20, 90)))
        Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(folder / f"{i}.png")
    (tmp_path / "raw" / "notes.txt").write_text("not an image")
    labelled = tmp_path / "labelled"
    for name, shade in (("dark", 40), ("light", 210)):
        (labelled / name).mkdir(parents=True)
        for i in range(8):
            Image.new("RGB", (30 + i, 28), (shade, shade, shade)).save(labelled / name / f"{i}.png")
    mae = ["--objective", "mae", "--preset", "tiny", "--threads", "1", "--no-progress", "--resolution", "28", "56"]
    mae += ["--batch-patches", "512", "--steps", "4", "--evals", "1", "--decoder-width", "32", "--decoder-heads", "2"]
    results = train(*mae, "--dataset", f"images:{tmp_path / 'raw'}", "--probe-dataset", f"imagefolder:{labelled}",
                    "--out", tmp_path / "run")  # fmt: skip
    assert results["test"] is None and results["sizes"]["test"] is None
    assert results["sizes"]["train"] + results["sizes"]["val"] == 24
    assert results["val"]["loss"] > 0 and 0.0 <= results["probe"]["top1"] <= 1.0
    assert (tmp_path / "run" / "probe" / "results.json").is_file()
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()


def test_unlabelled_data_is_refused_for_the_supervised_objective_and_one_class_is_fine_for_mae(tmp_path):
    (tmp_path / "raw" / "only").mkdir(parents=True)
    for i in range(6):
        Image.new("RGB", (28, 28), (i * 30, 0, 0)).save(tmp_path / "raw" / "only" / f"{i}.png")
    with pytest.raises(SystemExit, match=r"images:.* has no labels, and this objective learns from them"):
        train("--objective", "supervised", *TINY[2:], "--dataset", f"images:{tmp_path / 'raw'}", "--steps", "1",
              "--preset", "tiny", "--out", tmp_path / "o1")  # fmt: skip
    mae = ["--objective", "mae", "--preset", "tiny", *TINY[2:], "--batch-patches", "512", "--steps", "1"]
    results = train(*mae, "--evals", "0", "--dataset", f"imagefolder:{tmp_path / 'raw'}", "--out", tmp_path / "o2")
    assert results["objective"] == "mae" and results["steps"] == 1  # one class: no classifier, no refusal
