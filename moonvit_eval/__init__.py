"""Frozen-feature linear-probe evaluation of MoonViT encoders (``python -m moonvit_eval.linear_probe``).

Modules, one idea each:
    datasets: Fashion-MNIST (IDX files), scikit-learn's digits and ImageFolder trees as splits.
    splits: seeded stratified splits.
    encoder: building the encoder and hashing its weights.
    features: the feature views, pack-wise extraction (its forwards timed) and the on-disk feature cache.
    probe: standardisation and the two solvers (many-heads AdamW, L-BFGS logistic regression).
    knn: DINO's weighted kNN classifier (cosine, exp(sim / T) votes), queries in chunks.
    logreg: scikit-learn's logistic regression, C chosen on the probe's validation cut.
    metrics: top-k, per-class recall, confusion matrices.
    probe_run: the typed run of the command (ProbeRun: its settings, the probe's, kNN's and logreg's).
    probe_view: one feature view of a run: features, the three classifiers and images/s.
    report: results.json, the confusion-matrix PNG, the markdown table and the CSV of runs.
    linear_probe: the command line (parser, main, run).
"""

# first, before torch loads: the commands' OpenMP wait policy (see moonvit.environment)
import moonvit  # noqa: F401
