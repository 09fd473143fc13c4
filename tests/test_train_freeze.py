"""Fine-tuning part of a tower with `python -m moonvit_train`: --freeze tower, --freeze-blocks N and LoRA adapters
(--lora-rank): what trains and what stays bit for bit, what the optimizer holds, what autograd records,
what is saved, exact resume, and the settings as part of the run's identity; also under DDP and FSDP2."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from test_train import free_port, interrupted_then_resumed, run_ranks, train, weights

import moonvit.model.blocks as blocks
from moonvit import MoonViT, build_packed_grid
from moonvit.model.lora import LoRALinear, load_adapter
from moonvit_train.build import TrainError, build_encoder
from moonvit_train.config import parse_args
from moonvit_train.trainer import Trainer

TINY = ["--preset", "tiny", "--dataset", "digits", "--threads", "1", "--no-progress", "--resolution", "28"]
RUN = ["--objective", "supervised", *TINY, "--batch-patches", "1024", "--evals", "0", "--hflip", "0"]
RUN += ["--dtype", "fp32", "--drop-path", "0.1", "--lr", "3e-3"]


def watch(monkeypatch) -> dict:
    """After the next run: ``trainer``, its module's state before step 0 (``initial``), and for every
    block call that autograd could record (training forwards), whether its output needs a gradient."""
    seen: dict = {"block_grads": []}
    start, block_forward = Trainer.start, blocks.Block.forward

    def spy_start(self, total):
        start(self, total)
        seen["trainer"] = self
        seen["initial"] = {k: v.detach().clone() for k, v in self.parallel.module.state_dict().items()}

    def spy_block(self, *args, **kwargs):
        out = block_forward(self, *args, **kwargs)
        if torch.is_grad_enabled():
            seen["block_grads"].append(out.requires_grad)
        return out

    monkeypatch.setattr(Trainer, "start", spy_start)
    monkeypatch.setattr(blocks.Block, "forward", spy_block)
    return seen


def changed(seen: dict) -> set[str]:
    """Names of the module's tensors that training moved."""
    now = seen["trainer"].parallel.module.state_dict()
    return {name for name, before in seen["initial"].items() if not torch.equal(now[name], before)}


def optimized(trainer: Trainer) -> set[str]:
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    return {name for name, p in trainer.parallel.module.named_parameters() if id(p) in held}


def trainable(trainer: Trainer) -> set[str]:
    return {name for name, p in trainer.parallel.module.named_parameters() if p.requires_grad}


def test_a_frozen_tower_stays_bit_identical_while_the_head_trains(tmp_path, monkeypatch):
    seen = watch(monkeypatch)
    results = train(*RUN, "--steps", "3", "--freeze", "tower", "--out", tmp_path)
    trainer = seen["trainer"]
    assert changed(seen) == {"objective.norm.weight", "objective.norm.bias", "objective.head.weight",
                             "objective.head.bias"}  # fmt: skip
    assert optimized(trainer) == trainable(trainer) == changed(seen)  # AdamW's decay cannot reach the tower
    assert seen["block_grads"] and not any(seen["block_grads"])  # no graph through the tower
    assert all(block.drop_path == 0 for block in trainer.encoder.encoder.blocks)
    exported, initial = weights(tmp_path), seen["initial"]
    assert all(torch.equal(tensor, initial[f"encoder.{name}"]) for name, tensor in exported.items())
    assert results["encoder"]["trained"] == 0 and results["args"]["freeze"] == "tower"


def test_freeze_blocks_leaves_the_embedding_and_the_first_blocks_and_refuses_another_setting(tmp_path, monkeypatch):
    seen = watch(monkeypatch)
    train(*RUN, "--steps", "3", "--freeze-blocks", "1", "--out", tmp_path)
    trainer = seen["trainer"]
    moved = changed(seen)
    frozen = {
        name for name in seen["initial"] if name.startswith(("encoder.patch_embed.", "encoder.encoder.blocks.0."))
    }
    assert frozen and not frozen & moved  # bit for bit
    assert {"encoder.encoder.blocks.1.wqkv.weight", "encoder.encoder.final_layernorm.weight"} <= moved
    assert optimized(trainer) == trainable(trainer) == set(seen["initial"]) - frozen
    assert seen["block_grads"][:2] == [False, True]  # block 0 records nothing, block 1 does
    assert [block.drop_path for block in trainer.encoder.encoder.blocks] == [0.0, 0.1]

    monkeypatch.undo()
    with pytest.raises(SystemExit, match="--freeze-blocks = 1, but this command gives None"):
        train(*RUN, "--steps", "3", "--out", tmp_path)
    with pytest.raises(SystemExit, match="--freeze-blocks = 1, but this command gives 2"):
        train(*RUN, "--steps", "3", "--freeze-blocks", "2", "--out", tmp_path)


def test_lora_trains_only_its_adapters_saves_the_merged_tower_and_resumes_exactly(tmp_path, monkeypatch):
    args = [*RUN, "--steps", "4", "--save-every", "2", "--lora-rank", "4", "--lora-alpha", "8"]
    seen = watch(monkeypatch)
    results = train(*args, "--out", tmp_path / "straight")
    trainer = seen["trainer"]
    adapters = {name for name in seen["initial"] if name.endswith((".lora_a", ".lora_b"))}
    assert len(adapters) == 2 * 4 * 2  # A and B of wqkv, wo, fc0, fc1 in 2 blocks
    head = {name for name in seen["initial"] if name.startswith("objective.")}
    assert optimized(trainer) == trainable(trainer) == adapters | head
    assert {name for name in changed(seen) if name.startswith("encoder.")} <= adapters  # the base stays as it was
    assert all(seen["initial"][name].abs().max() == 0 for name in adapters if name.endswith("lora_b"))  # B = 0

    # The checkpoint is a plain tower, the adapters merged in: it computes what the wrapped tower computes.
    out = tmp_path / "straight"
    loaded = MoonViT.from_pretrained(out / "checkpoint")
    assert not any(isinstance(m, LoRALinear) for m in loaded.modules()) and not any("lora" in k for k in weights(out))
    wrapped = trainer.encoder.eval()
    pixels = torch.randn(20, 3, 14, 14)
    grid = build_packed_grid([[4, 4], [2, 2]], loaded.config)
    with torch.no_grad():
        expected = wrapped(pixels, grid=grid).last_hidden_state
        torch.testing.assert_close(loaded(pixels, grid=grid).last_hidden_state, expected, rtol=1e-5, atol=1e-5)
        # The adapter alone, on the tower it was trained from, gives the same tower.
        base = build_encoder(parse_args([*RUN, "--steps", "4", "--out", str(tmp_path / "x")]))[0].eval()
        assert load_adapter(base, out / "adapter")
        assert torch.equal(base(pixels, grid=grid).last_hidden_state, expected)
    assert results["files"][:2] == ["checkpoint", "adapter"]
    assert 0 < results["encoder"]["trained"] < results["encoder"]["parameters"] / 10
    monkeypatch.undo()

    interrupted_then_resumed(monkeypatch, args, tmp_path / "resumed")
    straight, resumed = weights(out), weights(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    adapter = load_file(out / "adapter" / "adapter.safetensors")
    assert adapter.keys() == load_file(tmp_path / "resumed" / "adapter" / "adapter.safetensors").keys()

    with pytest.raises(SystemExit, match="--lora-rank = 4, but this command gives 8"):
        train(*[a if a != "4" else "8" for a in args], "--out", out)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-alpha", "8"], "--lora-alpha sets up LoRA adapters: give their rank with --lora-rank"),
        (["--lora-rank", "4", "--freeze", "tower"], "--lora-rank already freezes the tower's own weights"),
        (["--freeze", "tower", "--freeze-blocks", "1"], "not allowed with argument"),
        (["--lora-rank", "4", "--lora-targets", "wqkv,,wo"], "give comma-separated linear names"),
    ],
)
def test_conflicting_or_incomplete_settings_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*RUN, "--steps", "1", "--out", "x", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_settings_that_do_not_fit_the_tower_are_refused_naming_it():
    with pytest.raises(TrainError, match="--freeze-blocks 3: the tower has 2 blocks"):
        build_encoder(parse_args([*RUN, "--steps", "1", "--out", "x", "--freeze-blocks", "3"]))
    with pytest.raises(TrainError, match=r"--lora-targets wqkv,fc2: LoRA targets fc2 name no linear .*'fc0', 'fc1'"):
        build_encoder(
            parse_args([*RUN, "--steps", "1", "--out", "x", "--lora-rank", "2", "--lora-targets", "wqkv,fc2"])
        )
    lora = parse_args([*RUN, "--steps", "1", "--out", "x", "--lora-rank", "2"]).model
    assert (lora.lora_alpha, lora.lora_dropout, lora.lora_targets) == (2.0, 0.0, ("wqkv", "wo", "fc0", "fc1"))
    plain = parse_args([*RUN, "--steps", "1", "--out", "x"]).model
    assert (plain.lora_alpha, plain.lora_dropout, plain.lora_targets) == (None, None, None)  # old runs resume


@pytest.mark.parametrize(
    "flags",
    [["--fsdp", "--freeze-blocks", "1"], ["--lora-rank", "4"]],
    ids=["FSDP2, first block frozen", "DDP, LoRA"],
)
def test_two_ranks_train_what_one_process_trains(tmp_path, flags):
    """Frozen weights are sharded by FSDP2 and left out of DDP's reduction: two gloo ranks end where one
    process ends, the frozen weights untouched on both."""
    args = [*RUN, "--steps", "3", "--packs-per-step", "2", *flags]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), "-m", "moonvit_train", *args, "--out", str(tmp_path / "ranks")]
    result = run_ranks(command, timeout=120)  # SIGKILLs every rank on a hang
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    train(*args, "--out", tmp_path / "one")
    one, two = weights(tmp_path / "one"), weights(tmp_path / "ranks")
    assert all((one[k] - two[k]).norm() <= 1e-5 * one[k].norm() for k in one)  # frozen zero biases: 0 <= 0
    if "--freeze-blocks" in flags:
        frozen = [k for k in one if k.startswith(("patch_embed.", "encoder.blocks.0."))]
        assert frozen and all(torch.equal(one[k], two[k]) for k in frozen)
    else:
        assert (tmp_path / "ranks" / "adapter" / "adapter.safetensors").is_file()


def test_the_default_targets_are_every_linear_of_a_block():
    linears = {
        name.rpartition(".")[2] for name, m in MoonViT.from_preset("tiny").named_modules() if type(m) is nn.Linear
    }
    model = parse_args([*RUN, "--steps", "1", "--out", "x", "--lora-rank", "1"]).model
    assert model.lora_targets is not None and set(model.lora_targets) == linears
