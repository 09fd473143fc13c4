"""`python -m moonvit_train` on the classic ViT / DeiT: supervised fine-tuning with the tower's head or the
trainer's, the higher-resolution fine-tune (the 1D table resampled once, 64 -> 96 px at patch 16), DeiT's
hard-label distillation against a teacher whose predictions the test sets, the saved checkpoint loading
back bit for bit, exact resumption, the optimiser's groups, and the refusals of what is MoonViT's alone."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_train import free_port, interrupted_then_resumed, run_ranks, train, weights

from moonvit import MoonViT, MoonViTImageProcessor, MoonViTOutput, preset_config
from moonvit.families.vit import ClassicViT, classic_vit_config
from moonvit_eval.datasets import Split
from moonvit_train.batch import ImageSource, render_pack
from moonvit_train.classic import fit_heads
from moonvit_train.objectives.deit import DeiTObjective, load_teacher_classifier
from moonvit_train.objectives.distill import TeacherError
from moonvit_train.objectives.supervised import POOLED_INPUT, SupervisedObjective
from moonvit_train.optim import OptimConfig, param_groups
from moonvit_train.plan import PlannedTrainImage

DIGITS = ["--dataset", "digits", "--threads", "1", "--no-progress", "--smoke", "--evals", "0"]
DIGITS += ["--resolution", "32", "48", "--batch-patches", "256", "--randaugment", "0", "0", "--lr", "3e-3"]
"""Digits at 32-48 px: 2x2 to 3x3 patches of 16 px (a grid that is not a merge of 2x2), evaluated on 256 images."""
TEACHER_CLASS = 3


def classic(name: str = "vit-tiny", seed: int = 0, **overrides) -> ClassicViT:
    torch.manual_seed(seed)
    return ClassicViT(classic_vit_config(name, **overrides))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Tiny classic towers on disk (64 px, patch 16: a 4x4 table): a ViT with a 10-class head, a DeiT with two
    heads of 1000 classes (refitted to the dataset's 10), and a teacher that always answers TEACHER_CLASS."""
    root = tmp_path_factory.mktemp("towers")
    classic(num_classes=10).save_pretrained(root / "vit")
    classic(seed=1, distillation_token=True, num_classes=1000, distilled_head=True).save_pretrained(root / "deit")
    teacher = classic(seed=2, num_classes=10)
    with torch.no_grad():
        teacher.head.weight.zero_()
        teacher.head.bias.zero_()
        teacher.head.bias[TEACHER_CLASS] = 100.0
    teacher.save_pretrained(root / "teacher")
    return {"vit": root / "vit", "deit": root / "deit", "teacher": root / "teacher"}


def saved_encoder(out: Path) -> dict[str, torch.Tensor]:
    """The trained tower's weights as the run's state holds them (its last step)."""
    model = torch.load(out / "state" / "last.pt", weights_only=False)["model"]
    return {name.removeprefix("encoder."): tensor for name, tensor in model.items() if name.startswith("encoder.")}


def assert_loads_back(out: Path) -> ClassicViT:
    """The exported checkpoint loads as a ClassicViT whose weights are the run's and whose outputs are those of
    the same tower built from the run's state, bit for bit (the same call on each)."""
    loaded = MoonViT.from_pretrained(out / "checkpoint")
    assert isinstance(loaded, ClassicViT)
    rebuilt = ClassicViT(loaded.config)
    rebuilt.load_state_dict(saved_encoder(out))
    exported = load_file(out / "checkpoint" / "model.safetensors")
    assert all(torch.equal(exported[name], tensor) for name, tensor in rebuilt.state_dict().items())
    pixels = torch.randn(4 + 6, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    grids = torch.tensor([[2, 2], [2, 3]])
    first, second = loaded.eval()(pixels, grids), rebuilt.eval()(pixels, grids)
    assert torch.equal(first.last_hidden_state, second.last_hidden_state)
    assert torch.equal(first.pooled, second.pooled)
    if loaded.config.num_classes:
        assert torch.equal(first.logits, second.logits)
    return loaded


# ---- a fixed pack, to check what each objective learns from --------------------------------------


def pack(count: int = 6, seed: int = 0, drop: bool = False):
    """A pack of ``count`` random RGB images of 2x2 to 3x3 patches (every other one with 2 patches dropped),
    labels 0..count-1, rendered as the trainer renders them (every patch kept in ``full_pixels``)."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (count, 48, 48, 3), dtype=np.uint8)
    processor = MoonViTImageProcessor(patch_size=16, merge_kernel_size=(1, 1))
    source = ImageSource(Split(images, np.arange(count) % 10), processor)
    grids = [(2, 2), (3, 2), (2, 3), (3, 3)]
    items = []
    for i in range(count):
        rows, cols = grids[i % len(grids)]
        kept = rows * cols - 2 if drop and i % 2 else rows * cols
        items.append(PlannedTrainImage(i, rows, cols, kept, 100 + i))
    return render_pack(items, source, classic_vit_config("vit-tiny"), None, full_pixels=True)


def fit(objective, encoder, batch, steps: int = 25, lr: float = 3e-3) -> list[float]:
    """Losses of ``steps`` Adam steps on one pack (a model that learns overfits it)."""
    params = [p for p in [*encoder.parameters(), *objective.parameters()] if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(steps):
        loss = objective(encoder, batch).loss_sum
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def each_image_alone(encoder: ClassicViT, batch) -> list[MoonViTOutput]:
    """``encoder`` on each image of ``batch`` alone (its kept patches on its own grid): one output per image."""
    outputs = []
    for i, rows in enumerate(batch.keep):
        start = sum(len(k) for k in batch.keep[:i])
        grid = encoder.prepare_grid(batch.grid.grid_thws[i : i + 1], keep=[rows])
        outputs.append(encoder(batch.pixel_values[start : start + len(rows)], grid=grid))
    return outputs


@pytest.mark.parametrize("tower_head", [True, False])
def test_the_supervised_loss_is_each_images_cross_entropy_and_falls(tower_head):
    """With the tower's head (``out.logits``) or the trainer's (LayerNorm -> Linear on ``out.pooled``), the packed
    loss is the sum of each image's cross-entropy, written out on its own; it falls on a pack it sees again."""
    encoder = classic(num_classes=10 if tower_head else 0)
    objective = SupervisedObjective(64, [str(i) for i in range(10)], 0.0, tower_head=tower_head, pooled=True)
    batch = pack(drop=True)
    loss = objective(encoder, batch).loss_sum
    alone = []
    for i, out in enumerate(each_image_alone(encoder, batch)):
        logits = out.logits if tower_head else objective.head(objective.norm(out.pooled))
        alone.append(F.cross_entropy(logits, batch.labels[i : i + 1]))
    torch.testing.assert_close(loss, sum(alone), rtol=1e-5, atol=1e-5)  # other pack shapes: float error
    losses = fit(objective, encoder, batch)
    assert losses[-1] < 0.5 * losses[0], losses


def test_deit_learns_the_teachers_argmax_in_its_second_head(folders):
    """loss = 0.5 CE(head 0, label) + 0.5 CE(head 1, the teacher's argmax), the teacher's argmax being
    TEACHER_CLASS for every image (its head says so) while the labels are 0..5; after a few steps on the pack
    the distillation head answers TEACHER_CLASS and the class head the labels."""
    student = classic(seed=1, distillation_token=True)
    fit_heads(student, 10, distilled=True)
    teacher = load_teacher_classifier(str(folders["teacher"]))
    classes = [str(i) for i in range(10)]
    objective = DeiTObjective(student, MoonViTImageProcessor(), teacher, classes, smoothing=0.0)
    batch = pack(drop=True)
    assert torch.equal(objective.teacher_labels(batch), torch.full((6,), TEACHER_CLASS))
    heads = student(batch.pixel_values, grid=batch.grid).head_logits
    expected = 0.5 * F.cross_entropy(heads[:, 0], batch.labels, reduction="sum")
    expected += 0.5 * F.cross_entropy(heads[:, 1], torch.full((6,), TEACHER_CLASS), reduction="sum")
    torch.testing.assert_close(objective(student, batch).loss_sum, expected, rtol=0, atol=0)
    # the teacher is frozen and outside what trains and what is saved
    assert not any(p.requires_grad for p in teacher.tower.parameters()) and not teacher.tower.training
    assert list(objective.parameters()) == [] and list(objective.state_dict()) == []
    losses = fit(objective, student, batch, steps=30)
    assert losses[-1] < 0.5 * losses[0], losses
    with torch.no_grad():
        heads = student.eval()(batch.pixel_values, grid=batch.grid).head_logits
    assert (heads[:, 1].argmax(dim=1) == TEACHER_CLASS).all()
    assert (heads[:, 0].argmax(dim=1) == batch.labels).all()


def test_a_supervised_run_folder_teaches_with_its_head_file(tmp_path):
    """A run's --out (checkpoint/ and head.safetensors) is a teacher: its logits are the saved head's on the tower's
    pooled feature; a tower without a head, and a teacher of other patches or classes, are refused by name."""
    tower = classic(seed=4)
    tower.save_pretrained(tmp_path / "run" / "checkpoint")
    head = SupervisedObjective(64, [str(i) for i in range(10)], pooled=True)
    torch.nn.init.normal_(head.head.weight)
    head.save(tmp_path / "run", head.state_dict())
    teacher = load_teacher_classifier(str(tmp_path / "run"))
    batch = pack()
    expected = head.classify(tower.eval()(batch.pixel_values, grid=batch.grid), batch.grid)
    assert torch.equal(teacher.logits(batch.pixel_values, batch.grid.grid_thws), expected)
    assert teacher.classes == tuple(str(i) for i in range(10))
    with pytest.raises(TeacherError, match="a tower without a head: the teacher must classify"):
        load_teacher_classifier(str(tmp_path / "run" / "checkpoint"))
    student = classic(distillation_token=True, num_classes=10, distilled_head=True)
    with pytest.raises(TeacherError, match="classifies into 10 classes, the dataset has 3"):
        DeiTObjective(student, MoonViTImageProcessor(), teacher, ["a", "b", "c"])
    classic(num_classes=10, patch_size=8).save_pretrained(tmp_path / "patch8")
    with pytest.raises(TeacherError, match=r"teacher's patches \(8 px, 3 channels\) are not the student's \(16 px"):
        DeiTObjective(
            student, MoonViTImageProcessor(), load_teacher_classifier(str(tmp_path / "patch8")), list("0123456789")
        )


def test_a_moonvit_run_folder_of_16_px_patches_teaches_on_whole_merges(tmp_path):
    """A MoonViT run's --out teaches too where its patches are the student's: its logits are its head file's on the
    patch mean, and the plan then rounds grids to its 2x2 merges (the objective's grid_unit)."""
    torch.manual_seed(6)
    tower = MoonViT(preset_config("tiny", patch_size=16))
    tower.save_pretrained(tmp_path / "run" / "checkpoint")
    head = SupervisedObjective(64, [str(i) for i in range(10)])
    head.save(tmp_path / "run", head.state_dict())
    teacher = load_teacher_classifier(str(tmp_path / "run"))
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.standard_normal((4 + 8, 3, 16, 16)).astype(np.float32))
    grids = torch.tensor([[1, 2, 2], [1, 2, 4]])
    grid = tower.prepare_grid(grids)
    expected = head.classify(tower.eval()(pixels, grid=grid), grid)
    assert torch.equal(teacher.logits(pixels, grids), expected)
    student = classic(distillation_token=True, num_classes=10, distilled_head=True)
    objective = DeiTObjective(student, MoonViTImageProcessor(), teacher, [str(i) for i in range(10)])
    assert objective.grid_unit == 2


def test_the_classic_towers_optimiser_groups():
    """No weight decay on the table and the prefix tokens (nor norms and biases); layer decay by block depth, the
    table and tokens at depth 0; the tower's heads at the objective's rate."""
    tower = classic(distillation_token=True, num_classes=10, distilled_head=True)
    groups = param_groups(
        tower, torch.nn.Linear(2, 2), OptimConfig(lr=1.0, head_lr=5.0, weight_decay=0.1, layer_decay=0.5)
    )
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    for token in (tower.pos_embed, tower.cls_token, tower.dist_token):
        assert id(token) not in decayed and lr_of[id(token)] == 0.5**3  # depth 0 of 2 blocks + final norm
    assert id(tower.blocks[0].attn.qkv.weight) in decayed and lr_of[id(tower.blocks[0].attn.qkv.weight)] == 0.5**2
    assert lr_of[id(tower.blocks[1].mlp.fc2.weight)] == 0.5 and lr_of[id(tower.norm.weight)] == 1.0
    assert lr_of[id(tower.head.weight)] == lr_of[id(tower.head_dist.bias)] == 5.0


# ---- whole runs ---------------------------------------------------------------------------------


def test_fine_tuning_a_vit_folder_with_its_head_and_token_drop(tmp_path, folders):
    """The folder's head (10 classes, the dataset's) trains as the classifier: no head file; the weights move; the
    checkpoint loads back as a ClassicViT with the same outputs."""
    results = train(*DIGITS, "--objective", "supervised", "--checkpoint", folders["vit"], "--steps", "4",
                    "--token-drop", "0.25", "--out", tmp_path)  # fmt: skip
    assert results["encoder"]["shape"].endswith("head 10") and results["files"] == ["checkpoint"]
    assert not (tmp_path / "head.safetensors").exists()
    loaded = assert_loads_back(tmp_path)
    before = load_file(folders["vit"] / "model.safetensors")
    after = loaded.state_dict()
    assert not torch.equal(before["head.weight"], after["head.weight"])
    assert not torch.equal(before["blocks.0.attn.qkv.weight"], after["blocks.0.attn.qkv.weight"])
    assert (tmp_path / "checkpoint" / "preprocessor_config.json").is_file()


def test_a_preset_trains_the_trainers_head_on_pooled_and_freeze_blocks_keeps_its_part(tmp_path):
    """--preset vit-tiny (no head): the trainer's head reads out.pooled (head.json says so); --freeze-blocks 1
    leaves the patch embedding, the table, the CLS token and block 0 as they were drawn."""
    results = train(*DIGITS, "--objective", "supervised", "--preset", "vit-tiny", "--steps", "3",
                    "--freeze-blocks", "1", "--out", tmp_path)  # fmt: skip
    assert results["files"] == ["checkpoint", "head.safetensors", "head.json"]
    assert json.loads((tmp_path / "head.json").read_text())["input"] == POOLED_INPUT
    drawn = classic().state_dict()  # --seed 0 draws the preset as classic() does
    trained = assert_loads_back(tmp_path).state_dict()
    for name in ("patch_embed.proj.weight", "pos_embed", "cls_token", "blocks.0.mlp.fc1.weight"):
        assert torch.equal(drawn[name], trained[name]), name
    assert not torch.equal(drawn["blocks.1.mlp.fc1.weight"], trained["blocks.1.mlp.fc1.weight"])


def test_the_table_resized_64_to_96_px_is_trained_and_saved_at_its_new_grid(tmp_path, folders):
    """--image-size 96 resamples the 4x4 table once to 6x6 by the tower's rule (the rows a 6x6 image read from
    the 64 px tower), trains at it and saves it: the checkpoint's native grid is 6x6. With the table frozen
    (--freeze-blocks 0) the saved table is the resampled one, bit for bit."""
    source = ClassicViT.from_pretrained(folders["vit"])
    resampled = source.position_table(6, 6)
    train(*DIGITS, "--objective", "supervised", "--checkpoint", folders["vit"], "--image-size", "96",
          "--resolution", "96", "--steps", "2", "--freeze-blocks", "0", "--out", tmp_path)  # fmt: skip
    loaded = assert_loads_back(tmp_path)
    assert loaded.config.image_size == 96 and loaded.config.grid_side == 6
    assert loaded.pos_embed.shape == (1, 1 + 36, 64)
    assert torch.equal(loaded.position_table(6, 6), resampled)
    assert torch.equal(loaded.pos_embed[0, 0], source.pos_embed[0, 0])  # the CLS row is kept as it is


def test_deit_distillation_run_resumes_exactly_and_saves_two_heads(tmp_path, folders, monkeypatch):
    """--objective deit from a DeiT folder (its 1000-class heads refitted to 10) and the always-3 teacher, with
    token drop and CutMix: interrupted at step 3 and resumed, the weights are the uninterrupted run's; the
    checkpoint holds both heads, and its distillation head has learned the teacher's answer."""
    args = [*DIGITS, "--objective", "deit", "--checkpoint", folders["deit"], "--teacher", folders["teacher"]]
    args += ["--token-drop", "0.25", "--cutmix", "1.0", "--head-lr", "3e-2", "--steps", "4", "--save-every", "2"]
    results = train(*args, "--out", tmp_path / "straight")
    assert results["objective"] == "deit" and results["test"]["teacher"] == "teacher"
    interrupted_then_resumed(monkeypatch, args, tmp_path / "resumed")
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    loaded = assert_loads_back(tmp_path / "straight")
    assert loaded.config.distilled_head and loaded.config.num_classes == 10
    batch = pack()
    with torch.no_grad():
        out = loaded(batch.pixel_values, grid=batch.grid)
    assert (out.head_logits[:, 1].argmax(dim=1) == TEACHER_CLASS).all()
    torch.testing.assert_close(out.logits, out.head_logits.mean(dim=1), rtol=0, atol=0)


def test_two_rank_ddp_fine_tunes_a_tower_with_transformers_pooler_as_one_process(tmp_path):
    """transformers' pooler reaches no loss: the trainer keeps it as loaded, out of DDP's reduction (which stalls
    on a parameter without a gradient); 2 gloo ranks then give one process's weights with the same packs."""
    classic(seed=5, num_classes=10, pooler=True).save_pretrained(tmp_path / "pooled")
    args = [*DIGITS, "--objective", "supervised", "--checkpoint", tmp_path / "pooled", "--steps", "3"]
    args = [str(a) for a in [*args, "--packs-per-step", "2", "--dtype", "fp32"]]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    command += [str(free_port()), "-m", "moonvit_train", *args, "--out", str(tmp_path / "ddp")]
    result = run_ranks(command)
    assert result.returncode == 0, result.stderr[-3000:]
    train(*args, "--out", tmp_path / "one")
    one = load_file(tmp_path / "one" / "checkpoint" / "model.safetensors")
    two = load_file(tmp_path / "ddp" / "checkpoint" / "model.safetensors")
    assert all(float((one[k] - two[k]).norm()) <= 1e-5 * float(one[k].norm()) for k in one)  # zero biases: 0 <= 0
    source = load_file(tmp_path / "pooled" / "model.safetensors")
    assert torch.equal(two["pooler.dense.weight"], source["pooler.dense.weight"])
    assert not torch.equal(two["head.weight"], source["head.weight"])


def test_feature_distillation_into_a_classic_tower_leaves_its_head_as_loaded(tmp_path, folders):
    """--objective distill (patch tokens against a teacher's) trains a classic ViT too; its head reaches no loss
    and stays as loaded."""
    args = [*DIGITS, "--objective", "distill", "--checkpoint", folders["vit"], "--teacher", folders["teacher"]]
    results = train(*args, "--calibration-images", "32", "--steps", "2", "--out", tmp_path)
    trained = assert_loads_back(tmp_path).state_dict()
    source = load_file(folders["vit"] / "model.safetensors")
    assert torch.equal(trained["head.weight"], source["head.weight"])
    assert not torch.equal(trained["blocks.1.mlp.fc2.weight"], source["blocks.1.mlp.fc2.weight"])
    assert results["encoder"]["trained"] == results["encoder"]["parameters"] - 64 * 10 - 10


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--objective", "mae", "--preset", "vit-tiny"], "--objective mae pretrains a MoonViT"),
        (["--objective", "supervised", "--preset", "vit-tiny", "--lora-rank", "4"], "--lora-rank adapts a MoonViT"),
        (["--objective", "supervised", "--preset", "vit-tiny", "--save-layout", "release"], "a classic ViT is saved"),
        (["--objective", "deit", "--preset", "vit-tiny", "--teacher", "TEACHER"], "trains a DeiT tower"),
        (["--objective", "deit", "--checkpoint", "DEIT", "--teacher", "DEIT"], "DEIT holds a tower without a head"),
        (["--objective", "supervised", "--checkpoint", "VIT", "--image-size", "72"], "72 is not a multiple of"),
    ],
)
def test_what_the_classic_tower_cannot_take_is_one_line(tmp_path, folders, flags, message):
    named = {"TEACHER": folders["teacher"], "DEIT": tmp_path / "headless", "VIT": folders["vit"]}
    classic(distillation_token=True).save_pretrained(tmp_path / "headless")
    flags = [str(named.get(flag, flag)) for flag in flags]
    message = message.replace("DEIT", str(tmp_path / "headless"))
    with pytest.raises(SystemExit, match="error: .*" + re.escape(message)):
        train(*DIGITS, *flags, "--steps", "1", "--out", tmp_path / "run")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--preset", "tiny", "--image-size", "96"], "--image-size resamples a classic ViT's 1D position table"),
        (["--preset", "vit-tiny", "--pos-emb-size", "8"], "--pos-emb-size shapes a MoonViT's 2D table"),
    ],
)
def test_a_table_flag_of_the_other_family_is_a_usage_error(tmp_path, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train(*DIGITS, "--objective", "supervised", *flags, "--steps", "1", "--out", tmp_path / "run")
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_presets_of_both_families_are_in_the_vocabulary():
    from moonvit.families.vit import PRESETS as CLASSIC
    from moonvit_train.config import PRESET_CHOICES, build_parser

    assert set(CLASSIC) <= set(PRESET_CHOICES) and "tiny" in PRESET_CHOICES
    assert build_parser().parse_args(["--preset", "deit-base-distilled-16"]).preset == "deit-base-distilled-16"
    assert preset_config("tiny").patch_size == 14  # the MoonViT preset of the same vocabulary
