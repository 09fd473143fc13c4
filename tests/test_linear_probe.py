"""The linear-probe solvers, metrics and CLI (``python -m moonvit_eval.linear_probe``)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from helpers import tiny_model
from PIL import Image

from moonvit_eval.datasets import load_dataset
from moonvit_eval.features import pixel_features
from moonvit_eval.linear_probe import main
from moonvit_eval.metrics import classification_metrics
from moonvit_eval.probe import ProbeConfig, Standardizer, fit_logistic_lbfgs, run_probe, train_adamw_heads


@pytest.fixture(scope="module")
def digits():
    dataset = load_dataset("digits", seed=0)
    train_x, test_x = pixel_features(dataset.train.images), pixel_features(dataset.test.images)
    scaler = Standardizer.fit(train_x)
    return (
        scaler(train_x),
        torch.from_numpy(dataset.train.labels),
        scaler(test_x),
        torch.from_numpy(dataset.test.labels),
    )


def test_lbfgs_matches_scikit_learn_logistic_regression(digits):
    from sklearn.linear_model import LogisticRegression

    train_x, train_y, test_x, test_y = digits
    c = 0.05
    ours = fit_logistic_lbfgs(train_x, train_y, 10, c, max_iter=2000, tolerance_grad=1e-9)
    reference = LogisticRegression(C=c, max_iter=5000, tol=1e-10).fit(train_x.numpy(), train_y.numpy())
    ours_pred = ours.logits(test_x)[0].argmax(1).numpy()
    reference_pred = reference.predict(test_x.numpy())
    assert abs((ours_pred == test_y.numpy()).mean() - (reference_pred == test_y.numpy()).mean()) <= 1 / len(test_y)
    assert (ours_pred == reference_pred).mean() >= 0.99
    # same optimum: scikit-learn's weights are ours up to a per-feature shift shared by the classes
    # (softmax invariance), which the L2 penalty pins to the same zero-mean solution
    np.testing.assert_allclose(ours.weight[:, 0].numpy().T, reference.coef_, atol=2e-3)


def test_digits_probe_on_raw_pixels_reaches_094(digits):
    train_x, train_y, test_x, test_y = digits
    for solver in ("adamw", "lbfgs"):
        result = run_probe(train_x, train_y, test_x, 10, ProbeConfig(solver=solver, min_steps=600))
        assert classification_metrics(result.test_logits, test_y)["top1"] >= 0.94, solver


def test_heads_train_independently_of_each_other(digits):
    train_x, train_y, _, _ = digits
    settings = dict(epochs=2, batch_size=256, seed=0)
    together = train_adamw_heads(
        train_x, train_y, 10, torch.tensor([1e-2, 1e-1]), torch.tensor([0.0, 1e-2]), **settings
    )
    alone = train_adamw_heads(train_x, train_y, 10, torch.tensor([1e-1]), torch.tensor([1e-2]), **settings)
    torch.testing.assert_close(together.weight[:, 1:], alone.weight, atol=1e-5, rtol=1e-4)


def test_selection_at_a_grid_edge_warns(digits):
    train_x, train_y, test_x, _ = digits
    with pytest.warns(UserWarning, match="C=0.001 is the largest"):
        result = run_probe(
            train_x, train_y, test_x, 10, ProbeConfig(solver="lbfgs", inverse_regularization=(1e-4, 1e-3))
        )
    assert result.edge_warnings and result.chosen["C"] == 1e-3
    assert result.sizes["select_val"] + result.sizes["select_train"] == result.sizes["train"]


def test_metrics_of_known_logits():
    logits = torch.eye(6)[[0, 1, 2, 3, 4, 0]] + torch.linspace(0, 0.5, 6)  # the last row predicts 0 for 5
    metrics = classification_metrics(logits, torch.tensor([0, 1, 2, 3, 4, 5]))
    assert metrics["top1"] == pytest.approx(5 / 6) and metrics["top5"] == pytest.approx(1.0)
    assert metrics["per_class_recall"] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert metrics["confusion"][5][0] == 1


FAST = ["--min-steps", "150", "--lrs", "0.01", "0.1", "--weight-decays", "0", "1e-2", "--threads", "2"]
FAST += ["--logreg-Cs", "0.1"]  # scikit-learn's logistic regression: one C (its grid is tested in test_knn.py)


def test_the_command_line_becomes_one_typed_run(tmp_path):
    from moonvit_eval.knn import KnnConfig
    from moonvit_eval.linear_probe import ProbeRun, build_parser
    from moonvit_eval.logreg import LogRegConfig

    argv = ["--preset", "tiny", "--random-init", "--dataset", "digits", "--out", str(tmp_path / "run"), *FAST]
    argv += ["--knn-k", "20", "10", "20", "--val-fraction", "0.2", "--seed", "3", "--no-baseline"]
    run = ProbeRun.from_args(build_parser().parse_args(argv), argv)
    assert run.probe == ProbeConfig(
        learning_rates=(0.01, 0.1), weight_decays=(0.0, 1e-2), min_steps=150, val_fraction=0.2, seed=3
    )
    assert run.knn == KnnConfig((10, 20), val_fraction=0.2, seed=3) and run.knn_columns == (10, 20)
    assert run.logreg == LogRegConfig(inverse_regularization=(0.1,), val_fraction=0.2, seed=3)
    assert run.views == ["mean"] and run.threads == 2 and run.dtype is None and run.preset == "tiny"
    assert run.cache_dir == tmp_path.resolve() / "feature-cache"
    assert run.results_csv == tmp_path.resolve() / "probe_results.csv"
    assert run.command == " ".join(["python -m moonvit_eval.linear_probe", *argv])
    skipped = ProbeRun.from_args(build_parser().parse_args([*argv, "--no-knn", "--no-logreg"]))
    assert skipped.knn is None and skipped.logreg is None and skipped.knn_columns == (10, 20)  # empty CSV cells


def test_cli_on_digits_writes_results_and_reuses_features(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--preset", "tiny", "--random-init", "--dataset", "digits", "--short-side", "56", "--out", str(out), *FAST]
    first = main(args)
    printed = capsys.readouterr()
    assert "| mean | adamw | 64 |" in printed.out
    # every stage after the features shows a bar, then a line with its seconds, for both views
    for view in ("mean", "pixels"):
        for stage in ("linear probe: search (4 heads)", "linear probe: refit", "kNN: test", "kNN: validation"):
            assert f"digits {view}: {stage}" in printed.err, stage
        for stage in ("linear probe", "kNN", "logistic regression"):
            assert re.search(f"digits {view}: {stage} took [0-9.]+ s", printed.err), stage
    # the output says the refit keeps the chosen C on more rows (a weaker penalty per row)
    assert re.search(r"C=0.1 chosen on 129[0-9] rows and refitted as it is on 1438: .* 1.1x weaker", printed.err)
    saved = json.loads((out / "results.json").read_text())
    assert [run["features"] for run in saved["runs"]] == ["mean", "pixels"]
    assert saved["runs"][1]["test"]["top1"] >= 0.9 and len(saved["per_class_recall"]) == 10
    assert saved["encoder"]["checkpoint_hash"] == first["encoder"]["checkpoint_hash"]
    assert saved["preprocessing"]["resize"]["short_side"] == 56 and saved["threads"] == 2
    assert Image.open(out / "confusion_mean.png").size[0] > 300 and (tmp_path / "feature-cache").is_dir()
    assert saved["runs"][1]["knn"]["test_top1"]["10"] >= 0.9 and saved["runs"][1]["logreg"]["test_top1"] >= 0.9
    second = main(args)
    assert second["runs"][0]["cache_hit"] == {"train": True, "test": True}
    assert second["top1"] == first["top1"] and second["chosen"] == first["chosen"]  # deterministic
    assert second["knn_top1"] == first["knn_top1"] and second["logreg_top1"] == first["logreg_top1"]
    # a row per view and run, in the CSV beside the output folder (as the feature cache)
    assert len((tmp_path / "probe_results.csv").read_text().splitlines()) == 1 + 2 * 2


def test_the_baseline_is_fitted_once_for_the_same_data_and_settings(tmp_path, capsys, monkeypatch):
    """The raw-pixels figures come from the cache on a rerun (the same numbers, and the output
    says so); a changed setting they depend on fits them again."""
    import moonvit_eval.linear_probe as linear_probe

    fits: list[str] = []
    fitted = linear_probe.probe_view

    def counted(view, *args, **kwargs):
        fits.append(view)
        return fitted(view, *args, **kwargs)

    monkeypatch.setattr(linear_probe, "probe_view", counted)
    args = ["--preset", "tiny", "--random-init", "--dataset", "digits", "--short-side", "28", *FAST]
    first = main([*args, "--out", str(tmp_path / "first")])
    assert fits == ["mean", "pixels"] and first["runs"][1]["cache_hit"]["results"] is False
    capsys.readouterr()

    second = main([*args, "--out", str(tmp_path / "second")])
    assert fits == ["mean", "pixels", "mean"]
    baseline = second["runs"][1]
    assert baseline["cache_hit"] == {"results": True}
    assert {**baseline, "cache_hit": None} == {**first["runs"][1], "cache_hit": None}
    printed = capsys.readouterr()
    assert "digits pixels: linear probe, kNN, logistic regression reused from the cache" in printed.err
    assert re.search(r"\| pixels \| adamw \| 64 \| .* \| cached \|", printed.out)
    first_png = (tmp_path / "first" / "confusion_pixels.png").read_bytes()
    assert (tmp_path / "second" / "confusion_pixels.png").read_bytes() == first_png
    rows = (tmp_path / "probe_results.csv").read_text().splitlines()
    assert rows[2].split(",")[8:] == rows[4].split(",")[8:]  # the pixels rows: the same figures

    for changed in (["--knn-temperature", "0.1"], ["--epochs", "2"]):
        main([*args, *changed, "--out", str(tmp_path / "changed")])
        assert fits[-1] == "pixels", changed
    assert fits.count("pixels") == 3


def test_ctrl_c_keeps_the_views_that_finished(tmp_path, capsys, monkeypatch):
    import moonvit_eval.linear_probe as linear_probe

    finished = linear_probe.probe_view

    def interrupted_at_pixels(view, *args, **kwargs):
        if view == "pixels":
            raise KeyboardInterrupt
        return finished(view, *args, **kwargs)

    monkeypatch.setattr(linear_probe, "probe_view", interrupted_at_pixels)
    out = tmp_path / "run"
    args = ["--preset", "tiny", "--random-init", "--dataset", "digits", "--short-side", "28", "--out", str(out), *FAST]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 130
    error = capsys.readouterr().err
    assert f"interrupted during the pixels view: {out / 'results.json'} holds the views that finished (mean)" in error
    saved = json.loads((out / "results.json").read_text())
    assert [run["features"] for run in saved["runs"]] == ["mean"] and saved["interrupted_views"] == ["pixels"]
    assert (out / "table.md").is_file() and not (tmp_path / "probe_results.csv").exists()  # whole runs only

    # interrupted before any view finished: one line, nothing written
    monkeypatch.setattr(linear_probe, "probe_view", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit) as exit_info:
        main([*args[: -len(FAST)], "--out", str(tmp_path / "none"), *FAST])
    assert exit_info.value.code == 130
    assert "interrupted during the mean view; nothing was written" in capsys.readouterr().err
    assert not (tmp_path / "none" / "results.json").exists()


def test_cli_probes_a_checkpoint_folder(tmp_path):
    tiny_model(0).save_pretrained(tmp_path / "ckpt")
    results = main(
        [
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--dataset",
            "digits",
            "--short-side",
            "28",
            "--no-baseline",
            "--solver",
            "lbfgs",
            "--Cs",
            "0.1",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--threads",
            "2",
        ]
    )
    assert len(results["runs"]) == 1 and results["encoder"]["source"].startswith("checkpoint:")
    assert set(results["chosen"]) == {"C"} and results["top1"] > 0.5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "tiny", "--dataset", "digits"], "--random-init"),
        (["--preset", "tiny", "--random-init", "--dataset", "cifar"], "unknown --dataset 'cifar'"),
        (["--dataset", "digits"], "needs an encoder"),
        (["--checkpoint", "/nonexistent", "--dataset", "digits"], "argument --checkpoint: /nonexistent does not exist"),
        (["--preset", "tiny", "--random-init", "--dataset", "digits", "--val-fraction", "1"], "a fraction in (0, 1)"),
        (
            ["--preset", "tiny", "--random-init", "--dataset", "fashion-mnist", "--data-dir", "/nonexistent"],
            "does not exist",
        ),
    ],
)
def test_cli_errors_name_the_problem(args, message, capsys):
    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err
