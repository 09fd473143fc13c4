#!/usr/bin/env bash
# Set up .venv if needed, then run the main job on its built-in default:
#   1. encode the built-in sample images with the shipped checkpoint trained on
#      Fashion-MNIST (checkpoints/fm-supervised) unless a --checkpoint or --preset
#      is given, saving the encoder as a checkpoint folder and the images as PNG files;
#      without a source of the user's, also with a random-weight tower of the real
#      K2.5 size (so400m-3d) on the same images and a built-in clip, for the shapes;
#   2. export their visual tokens from that folder (python -m moonvit_projector.export);
#   3. linear-probe the three shipped checkpoints on scikit-learn's digits, which
#      none of them saw, and the best on Fashion-MNIST's test split (when Debian's
#      dataset-fashion-mnist is installed; MOONVIT_DEMO_FASHION_MNIST=0 skips this
#      probe, about two minutes, most of it the features of 70,000 images), each
#      against raw pixels;
#      MOONVIT_DEMO_PROBES=0 skips the probes altogether.
# Arguments go to step 1 (`bash scripts/demo.sh --help` lists them); the demo sets
# --out, --save-checkpoint and --save-images itself. Each run replaces the output
# folder (outputs/demo, or $MOONVIT_DEMO_OUT) as a whole: the previous run's folder
# is moved aside first and put back if any step fails, so the folder always holds
# one complete run. An interrupted run (Ctrl-C) keeps the steps it finished in
# <folder>.interrupted, with the probes' figures so far, and the previous run is put back.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

help=0
source=(--checkpoint checkpoints/fm-supervised)
for arg in "$@"; do
    case "$arg" in
        -h | --help) help=1 ;;
        # a source of the user's (--checkpoint, --preset, or a prefix of either) replaces the default
        --c* | --p*) source=() ;;
        # with argparse's prefixes: --ou for --out, --save-c for --save-checkpoint, ...
        --o | --o=* | --ou | --ou=* | --out | --out=* | --sa | --sa=* | --sav | --sav=* | --save*)
            echo "demo.sh: ${arg%%=*} is set by the demo (its output folder is \$MOONVIT_DEMO_OUT," \
                "default outputs/demo); run python -m moonvit to choose it" >&2
            exit 2
            ;;
    esac
done

bash "$root/scripts/setup.sh"
cd "$root"
if [ "$help" = 1 ]; then
    echo "usage: bash scripts/demo.sh [python -m moonvit arguments]"
    echo
    echo "Encodes images (python -m moonvit; default: the shipped checkpoints/fm-supervised),"
    echo "exports their tokens (python -m moonvit_projector.export) and linear-probes the shipped"
    echo "checkpoints on digits (python -m moonvit_eval.linear_probe), all into"
    echo "\${MOONVIT_DEMO_OUT:-outputs/demo}. The arguments below go to the first step."
    echo
    exec .venv/bin/python -m moonvit --help
fi

out="${MOONVIT_DEMO_OUT:-outputs/demo}"
previous="$out.previous"
partial="$out.interrupted"
rm -rf "$previous" "$partial"
if [ -e "$out" ]; then
    mv "$out" "$previous"
fi

# The probes' test top-1 so far, one line per probe folder of $1 that has its results.json.
summarize_probes() {
    [ -d "$1" ] || return 0
    .venv/bin/python - "$1" <<'PY'
import json, sys
from pathlib import Path

print("\nlinear probes of the shipped checkpoints, test top-1:")
for folder in sorted(f for f in Path(sys.argv[1]).iterdir() if (f / "results.json").exists()):
    runs = json.loads((folder / "results.json").read_text())["runs"]
    print(f"  {folder.name:<28}" + "".join(f"  {r['features']} {r['test']['top1']:.4f}" for r in runs))
PY
}

step="setting up"
interrupted=0
finish() {
    local status=$?
    trap - INT TERM  # a second Ctrl-C does not cut the clean-up short
    # 130: a step that caught the Ctrl-C itself and exited with the shell's status for it
    if { [ "$interrupted" = 1 ] || [ "$status" = 130 ]; } && [ -e "$out" ]; then
        # keep what this run finished, out of the way of the complete previous run
        mv "$out" "$partial"
        local kept="the steps this run finished are kept in $partial"
        if [ -e "$previous" ]; then
            mv "$previous" "$out"
            kept="$kept, and $out is left as the previous run wrote it"
        fi
        summarize_probes "$partial/probe" || true
        echo "demo.sh: interrupted during $step; $kept" >&2
    elif [ "$status" -ne 0 ]; then
        rm -rf "$out"
        if [ -e "$previous" ]; then
            mv "$previous" "$out"
            echo "demo.sh: a step failed; $out is left as the previous run wrote it" >&2
        fi
    fi
    exit "$status"
}
trap finish EXIT
trap 'interrupted=1; exit 130' INT TERM

step="the encoding (python -m moonvit)"
.venv/bin/python -m moonvit "${source[@]}" --out "$out" --save-checkpoint "$out/checkpoint" \
    --save-images "$out/images" "$@"
if [ "${#source[@]}" -gt 0 ]; then
    # the real size with random weights, for the shapes: a K2.5 tower (1152 wide, 27 blocks) on the
    # same images and a built-in clip, under K2.5's processor rule with items capped at 4096 patches
    # (the largest sample image would take 9,472 and triple the step's time on 2 cores)
    step="the so400m-3d encoding"
    .venv/bin/python -m moonvit --preset so400m-3d --max-patches-per-pack 4096 --out "$out/so400m-3d" "$@"
fi
step="the export (python -m moonvit_projector.export)"
.venv/bin/python -m moonvit_projector.export --inputs "$out/images" --checkpoint "$out/checkpoint" --out "$out/export" \
    --store merged --shard-size 2
# Probes of the shipped checkpoints: digits (never seen in training) for the three, Fashion-MNIST's
# test split for the best; each with the raw-pixel baseline beside it on its first run.
if [ "${MOONVIT_DEMO_PROBES:-1}" = 0 ]; then
    echo "demo.sh: MOONVIT_DEMO_PROBES=0: the linear probes are skipped" >&2
    rm -rf "$previous"
    exit 0
fi
baseline=()
for name in fm-mae fm-supervised fm-mae-ft; do
    step="the digits probe of $name"
    .venv/bin/python -m moonvit_eval.linear_probe --checkpoint "checkpoints/$name" --dataset digits \
        --out "$out/probe/digits-$name" --cache-dir "$out/probe-cache" "${baseline[@]}"
    baseline=(--no-baseline)
done
if [ "${MOONVIT_DEMO_FASHION_MNIST:-1}" = 0 ]; then
    echo "demo.sh: MOONVIT_DEMO_FASHION_MNIST=0: the Fashion-MNIST probe is skipped" >&2
elif .venv/bin/python -c "import sys; from moonvit_eval.datasets import DEFAULT_FASHION_MNIST_DIR as d; sys.exit(not d.is_dir())"
then
    step="the Fashion-MNIST probe of fm-mae-ft"
    # no logistic regression here: on the 784-wide raw pixels of 60,000 images it alone takes longer
    # than the rest of this probe (about 110 s on one core); python -m moonvit_eval.linear_probe runs it
    .venv/bin/python -m moonvit_eval.linear_probe --checkpoint checkpoints/fm-mae-ft --dataset fashion-mnist --short-side 56 \
        --out "$out/probe/fashion-mnist-fm-mae-ft" --cache-dir "$out/probe-cache" --no-logreg
else
    echo "demo.sh: Fashion-MNIST is not installed (Debian's dataset-fashion-mnist); its probe is skipped" >&2
fi
step="the summary"
summarize_probes "$out/probe"
rm -rf "$previous"
