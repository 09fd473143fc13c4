"""The figures ``python -m moonvit_eval.linear_probe`` reports beside the linear probe: the weighted kNN
classifier (against a NumPy reference), scikit-learn's logistic regression, the encoder's images/s
and the CSV that collects runs."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from moonvit_eval.datasets import load_dataset
from moonvit_eval.features import pixel_features
from moonvit_eval.knn import KnnConfig, knn_predict, run_knn
from moonvit_eval.linear_probe import main
from moonvit_eval.logreg import LogRegConfig, run_logreg
from moonvit_eval.probe import Standardizer
from moonvit_eval.splits import stratified_split

# ---- kNN -----------------------------------------------------------------------------------------


def reference_knn(bank_x, bank_y, query_x, num_classes, k, temperature=0.07):
    """DINO's weighted vote written out in float64: dense cosines, a sort per query, a loop over neighbours."""
    bank = np.asarray(bank_x, dtype=np.float64)
    query = np.asarray(query_x, dtype=np.float64)
    bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    query = query / np.linalg.norm(query, axis=1, keepdims=True)
    similarity = query @ bank.T
    predictions = []
    for row in similarity:
        nearest = np.argsort(-row, kind="stable")[: min(k, len(bank))]
        votes = np.zeros(num_classes)
        for index in nearest:
            votes[bank_y[index]] += np.exp(row[index] / temperature)
        predictions.append(int(np.argmax(votes)))
    return np.array(predictions)


def random_set(seed=0, sizes=(3, 9, 20, 28), queries=40, dim=6):
    """A bank whose classes have 3 to 28 rows around shifted centres, and queries near them."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(len(sizes), dim))
    labels = np.concatenate([np.full(n, c) for c, n in enumerate(sizes)])
    bank = centres[labels] + rng.normal(scale=1.2, size=(len(labels), dim))
    query_labels = rng.integers(0, len(sizes), queries)
    query = centres[query_labels] + rng.normal(scale=1.2, size=(queries, dim))
    return bank, labels, query, query_labels


def assert_ties_free(bank, query, ks):
    """The k-th and (k+1)-th cosines differ by far more than float32 rounding, so the neighbours are well defined."""
    bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    query = query / np.linalg.norm(query, axis=1, keepdims=True)
    ordered = -np.sort(-(query @ bank.T), axis=1)
    for k in ks:
        if k < bank.shape[0]:
            assert np.min(ordered[:, k - 1] - ordered[:, k]) > 1e-5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_knn_matches_a_numpy_reference(seed):
    bank, labels, query, _ = random_set(seed)
    ks = (1, 5, 10, 20, 200)  # 5 and more exceed the 3-row class; 200 exceeds the bank: every row votes
    assert_ties_free(bank, query, ks)
    ours = knn_predict(torch.from_numpy(bank).float(), torch.from_numpy(labels), torch.from_numpy(query).float(), 4, ks)
    for k in ks:
        np.testing.assert_array_equal(ours[k].numpy(), reference_knn(bank, labels, query, 4, k), err_msg=f"k={k}")
    # another temperature weights the votes differently, and still agrees (float64 features stay float64)
    warm = knn_predict(
        torch.from_numpy(bank), torch.from_numpy(labels), torch.from_numpy(query), 4, [10], temperature=1
    )
    np.testing.assert_array_equal(warm[10].numpy(), reference_knn(bank, labels, query, 4, 10, temperature=1.0))


def test_knn_votes_are_weighted_not_counted():
    # one very close neighbour of class 0 against two far ones of class 1: with exp(sim / 0.07) the close one wins
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.05, 1.0]])
    labels = torch.tensor([0, 1, 1])
    query = torch.tensor([[1.0, 0.02]])
    assert knn_predict(bank, labels, query, 2, [3])[3].tolist() == [0]
    assert reference_knn(bank.numpy(), labels.numpy(), query.numpy(), 2, 3).tolist() == [0]


def test_chunked_queries_give_the_unchunked_predictions():
    bank, labels, query, _ = random_set(3, sizes=(15, 25, 40), queries=37, dim=16)
    args = (torch.from_numpy(bank).float(), torch.from_numpy(labels), torch.from_numpy(query).float(), 3, (1, 10, 20))
    whole = knn_predict(*args, chunk_size=len(query))
    for chunk_size in (1, 5, 36, None):
        chunked = knn_predict(*args, chunk_size=chunk_size)
        for k in whole:
            torch.testing.assert_close(chunked[k], whole[k], rtol=0, atol=0)


def test_run_knn_scores_test_on_train_and_the_probes_validation_cut_on_the_rest():
    bank, labels, query, query_labels = random_set(4, sizes=(30, 40, 50), queries=60)
    train_x, train_y = torch.from_numpy(bank).float(), torch.from_numpy(labels)
    config = KnnConfig(ks=(10, 20), val_fraction=0.2, seed=5)
    result = run_knn(train_x, train_y, torch.from_numpy(query).float(), torch.from_numpy(query_labels), 3, config)
    kept, held = stratified_split(labels, 0.2, 5)
    for k in (10, 20):
        test = (reference_knn(bank, labels, query, 3, k) == query_labels).mean()
        val = (reference_knn(bank[kept], labels[kept], bank[held], 3, k) == labels[held]).mean()
        assert result.test_top1[k] == pytest.approx(test) and result.val_top1[k] == pytest.approx(val)
    assert result.sizes == {"bank": 120, "test": 60, "val_bank": len(kept), "val": len(held)}
    assert len(held) == 24 and result.effective_k == {10: 10, 20: 20}


def test_knn_refuses_an_empty_bank_or_no_k():
    with pytest.raises(ValueError, match="no rows"):
        knn_predict(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), torch.ones(2, 3), 2, [10])
    with pytest.raises(ValueError, match="at least 1"):
        knn_predict(torch.ones(4, 3), torch.zeros(4, dtype=torch.long), torch.ones(2, 3), 2, [])


# ---- logistic regression -------------------------------------------------------------------------


def test_logreg_chooses_c_from_its_grid_on_the_validation_cut_and_refits_on_train():
    from sklearn.linear_model import LogisticRegression

    dataset = load_dataset("digits", seed=0)
    train_x, test_x = pixel_features(dataset.train.images), pixel_features(dataset.test.images)
    train_y, test_y = torch.from_numpy(dataset.train.labels), torch.from_numpy(dataset.test.labels)
    config = LogRegConfig(inverse_regularization=(0.1, 1.0, 10.0), max_iter=500, max_search_rows=None)
    result = run_logreg(train_x, train_y, test_x, test_y, config, threads=1)
    assert [s["C"] for s in result.grid] == [0.1, 1.0, 10.0] and result.chosen_C in (0.1, 1.0, 10.0)
    best = max(s["val_top1"] for s in result.grid)
    assert result.chosen_C == next(s["C"] for s in result.grid if s["val_top1"] == best)  # ties: the smallest C
    assert result.sizes["select_train"] + result.sizes["select_val"] == result.sizes["train"] == len(train_x)
    # the refit is scikit-learn's fit on all of train, standardised with all of train's statistics,
    # with the chosen C as it is (see the next test)
    assert result.refit["C"] == result.chosen_C and result.refit["rows"] == len(train_x)
    scaler = Standardizer.fit(train_x)
    direct = LogisticRegression(C=result.refit["C"], max_iter=500).fit(scaler(train_x).numpy(), train_y.numpy())
    np.testing.assert_array_equal(result.test_predictions, direct.predict(scaler(test_x).numpy()))
    assert result.test_top1 == pytest.approx((result.test_predictions == test_y.numpy()).mean())
    assert result.test_top1 > 0.9

    # a subsampled search: fewer rows to choose C on (stratified), the same validation cut, the refit on all
    small = run_logreg(train_x, train_y, test_x, test_y, LogRegConfig(max_search_rows=300), threads=1)
    assert 290 <= small.sizes["select_train"] <= 310 and small.sizes["select_val"] == result.sizes["select_val"]
    assert small.sizes["train"] == len(train_x) and small.test_top1 > 0.9
    assert small.refit == {**small.refit, "C": small.chosen_C, "rows": len(train_x)}


def test_scikit_learns_c_weighs_the_sum_of_the_losses():
    """What the refit's C means on more rows: scikit-learn minimises ``C * sum of losses + ||W||^2 / 2``,
    so k copies of every row with C / k is the same objective times k (the same solution), and the
    same C on the k-fold rows is a weaker penalty per row (the refit keeps it so, see eval.logreg)."""
    from sklearn.linear_model import LogisticRegression

    dataset = load_dataset("digits", seed=0)
    pixels = pixel_features(dataset.train.images)
    x = Standardizer.fit(pixels)(pixels)[:300].double().numpy()  # float64: the optima agree to 1e-6
    y = dataset.train.labels[:300]
    copies = 3
    scaled_c = 0.01 / copies

    def fit(rows, labels, c):
        return LogisticRegression(C=c, max_iter=5000, tol=1e-10).fit(rows, labels).coef_

    once = fit(x, y, 0.01)
    many, many_y = np.concatenate([x] * copies), np.concatenate([y] * copies)
    np.testing.assert_allclose(fit(many, many_y, scaled_c), once, atol=1e-6)
    unscaled = fit(many, many_y, 0.01)
    assert np.linalg.norm(unscaled) > 1.3 * np.linalg.norm(once)  # the same C: a weaker penalty per row


# ---- the command line: figures, images/s and the CSV ---------------------------------------------------

FAST = ["--min-steps", "100", "--lrs", "0.1", "--weight-decays", "0", "--threads", "1", "--short-side", "28"]


def probe(tmp_path, *extra):
    args = ["--preset", "tiny", "--random-init", "--dataset", "digits", "--no-baseline", "--out", str(tmp_path / "out")]
    return main([*args, *FAST, "--results-csv", str(tmp_path / "runs.csv"), *extra])


def read_csv(path):
    with path.open(newline="") as file:
        return list(csv.reader(file))


def test_cli_reports_knn_logreg_and_images_per_s_and_appends_one_csv_row_per_run(tmp_path, capsys):
    first = probe(tmp_path, "--logreg-Cs", "0.1", "1", "10")
    printed = capsys.readouterr().out
    assert "| logreg top-1 | kNN k=10 top-1 | kNN k=20 top-1 | img/s |" in printed and "images/s: " in printed
    run = first["runs"][0]
    assert run["logreg"]["chosen"]["C"] in (0.1, 1.0, 10.0) and len(run["logreg"]["validation_grid"]) == 3
    assert set(run["knn"]["test_top1"]) == set(run["knn"]["val_top1"]) == {"10", "20"}
    assert first["knn_top1"] == run["knn"]["test_top1"] and first["logreg_top1"] == run["logreg"]["test_top1"]
    assert first["speed"]["images_timed"] == 359 and "extracted" in first["speed"]["measured_on"]
    assert first["speed"]["threads"] == 1 and first["speed"]["dtype"] == "fp32" and first["images_per_s"] > 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["runs"][0]["logreg"] == run["logreg"] and saved["runs"][0]["knn"] == run["knn"]
    assert "kNN k=20 top-1" in (tmp_path / "out" / "table.md").read_text()

    rows = read_csv(tmp_path / "runs.csv")
    assert rows[0] == [
        "timestamp", "encoder", "dataset", "features", "short_side", "dtype", "device", "threads",
        "linear_top1", "logreg_top1", "knn10_top1", "knn20_top1", "images_per_s",
    ]  # fmt: skip
    assert len(rows) == 2
    row = dict(zip(rows[0], rows[1]))
    assert row["encoder"].startswith("preset:tiny") and row["dataset"] == "digits" and row["features"] == "mean"
    assert (row["short_side"], row["dtype"], row["threads"]) == ("28", "fp32", "1")
    assert float(row["linear_top1"]) == pytest.approx(first["top1"], abs=1e-4)
    assert float(row["logreg_top1"]) == pytest.approx(run["logreg"]["test_top1"], abs=1e-4)
    assert float(row["knn20_top1"]) == pytest.approx(run["knn"]["test_top1"]["20"], abs=1e-4)

    # features from the cache: images/s is still measured (on the test split's first images), the
    # figures are the same, and the CSV gains one row; without kNN and logreg their cells stay empty
    second = probe(tmp_path, "--no-knn", "--no-logreg")
    assert second["runs"][0]["cache_hit"] == {"train": True, "test": True} and second["top1"] == first["top1"]
    assert second["images_per_s"] > 0 and "from the cache" in second["speed"]["measured_on"]
    assert second["runs"][0]["knn"] is None and second["logreg_top1"] is None
    rows = read_csv(tmp_path / "runs.csv")
    assert len(rows) == 3 and rows[2][3] == "mean" and rows[2][9:12] == ["", "", ""] and float(rows[2][12]) > 0
    assert "kNN" not in capsys.readouterr().out.splitlines()[0]


def test_a_csv_with_another_header_is_refused_before_any_work(tmp_path, capsys):
    path = tmp_path / "runs.csv"
    path.write_text("timestamp,encoder,top1\n2024-01-01,x,0.5\n")
    with pytest.raises(SystemExit) as exit_info:
        probe(tmp_path)
    assert exit_info.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and str(path) in error[0] and "header" in error[0], error
    assert path.read_text() == "timestamp,encoder,top1\n2024-01-01,x,0.5\n"  # untouched
    assert not (tmp_path / "feature-cache").exists() and not (tmp_path / "out" / "results.json").exists()


def test_other_knn_ks_are_other_columns_and_refused_in_a_file_with_the_defaults(tmp_path, capsys):
    probe(tmp_path, "--no-logreg", "--knn-k", "20", "5")
    header = read_csv(tmp_path / "runs.csv")[0]
    assert [c for c in header if c.startswith("knn")] == ["knn5_top1", "knn20_top1"]
    with pytest.raises(SystemExit):
        probe(tmp_path, "--no-logreg")  # the default ks write other columns
    assert "lacks knn10_top1" in capsys.readouterr().err
    assert len(read_csv(tmp_path / "runs.csv")) == 2
