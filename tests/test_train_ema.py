"""--ema: a moving average of the trained weights, what the run validates, tests and saves; kept with
the state (exact resume, any world size) and part of the run's identity."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from test_train import free_port, interrupt_at_step, run_ranks, train, weights

from moonvit_train.ema import WeightEMA
from moonvit_train.trainer import Trainer

TINY = ["--preset", "tiny", "--dataset", "digits", "--threads", "1", "--no-progress", "--resolution", "28"]
RUN = ["--objective", "supervised", *TINY, "--batch-patches", "1024", "--evals", "1", "--hflip", "0"]
RUN += ["--dtype", "fp32", "--lr", "3e-3", "--ema", "0.9"]


def test_the_average_follows_the_trained_parameters_with_a_warmed_up_decay():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    module[1].requires_grad_(False)
    ema = WeightEMA(module, decay=0.5)
    assert ema.names == ["0.weight", "0.bias"]  # frozen weights are their own average
    expected = [p.detach().clone() for p in ema.params]
    for n in range(1, 4):
        with torch.no_grad():
            for p in ema.params:
                p.add_(torch.randn_like(p))
        decay = min(0.5, (1 + n) / (10 + n))
        expected = [decay * e + (1 - decay) * p.detach() for e, p in zip(expected, ema.params)]
        ema.update()
    assert all(torch.allclose(a, e) for a, e in zip(ema.averages, expected))
    trained, averages = [p.detach().clone() for p in ema.params], [a.clone() for a in ema.averages]
    with ema.swapped():
        assert all(torch.equal(p, a) for p, a in zip(ema.params, averages))
    assert all(torch.equal(p, t) for p, t in zip(ema.params, trained))  # swapped back exactly
    assert all(torch.equal(a, e) for a, e in zip(ema.averages, averages))


def test_the_run_saves_the_average_resumes_it_exactly_and_refuses_another_decay(tmp_path, monkeypatch):
    args = [*RUN, "--steps", "4", "--save-every", "2", "--freeze-blocks", "1"]
    seen: dict = {}
    start = Trainer.start

    def spy(self, total):
        start(self, total)
        seen["trainer"] = self

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "start", spy)
        train(*args, "--out", tmp_path / "straight")
    ema = seen["trainer"].ema
    assert ema is not None and ema.updates == 4
    assert not any(name.startswith(("encoder.patch_embed.", "encoder.encoder.blocks.0.")) for name in ema.names)

    state = torch.load(tmp_path / "straight" / "state" / "last.pt", weights_only=False)
    averages, raw = state["ema"]["weights"], state["model"]
    exported, head = weights(tmp_path / "straight"), load_file(tmp_path / "straight" / "head.safetensors")
    for name, average in averages.items():
        part, _, rest = name.partition(".")
        saved = exported[rest] if part == "encoder" else head[rest]
        assert torch.equal(saved, average) and not torch.equal(average, raw[name])  # the average is what is saved
    assert torch.equal(exported["encoder.blocks.0.wqkv.weight"], raw["encoder.encoder.blocks.0.wqkv.weight"])

    with monkeypatch.context() as patch:
        interrupt_at_step(patch, 3)
        with pytest.raises(SystemExit):
            train(*args, "--out", tmp_path / "resumed")
    train(*args, "--out", tmp_path / "resumed")
    resumed = weights(tmp_path / "resumed")
    assert all(torch.equal(exported[k], resumed[k]) for k in exported)

    with pytest.raises(SystemExit, match="--ema = 0.9, but this command gives 0.99"):
        train(*[a if a != "0.9" else "0.99" for a in args], "--out", tmp_path / "straight")


def test_fsdp2_resumes_the_average_into_its_shards_and_gathers_it(tmp_path, monkeypatch):
    """Saved by one process, resumed on two FSDP2 ranks: each rank averages its own shards, and
    gathered they are the uninterrupted process's average."""
    args = [*RUN, "--steps", "4", "--save-every", "2", "--packs-per-step", "2", "--evals", "0", "--fsdp"]
    train(*args, "--out", tmp_path / "one")
    with monkeypatch.context() as patch:
        interrupt_at_step(patch, 3)
        with pytest.raises(SystemExit):
            train(*args, "--out", tmp_path / "ranks")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    command += [str(free_port()), "-m", "moonvit_train", *args, "--out", str(tmp_path / "ranks")]
    result = run_ranks(command, timeout=120)  # SIGKILLs every rank on a hang
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming" in result.stdout and "at step 2 of 4 (2 ranks)" in result.stdout, result.stdout
    one, two = weights(tmp_path / "one"), weights(tmp_path / "ranks")
    assert all((one[k] - two[k]).norm() <= 1e-5 * one[k].norm() for k in one)
    state = torch.load(tmp_path / "ranks" / "state" / "last.pt", weights_only=False)
    assert state["ema"]["updates"] == 4 and torch.equal(
        state["ema"]["weights"]["encoder.encoder.blocks.1.wo.weight"], two["encoder.blocks.1.wo.weight"]
    )
