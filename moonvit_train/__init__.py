"""Training MoonViT encoders on packed native-resolution images: ``python -m moonvit_train``.

Modules, one idea each:
    config      the command line, ``--smoke``, the objective's defaults: a typed TrainConfig
    data        the dataset's train split cut into training and validation parts, and its test split;
                or a folder of unlabelled images (``images:DIR``)
    plan        sizes only: random resizing, token dropping, the image stream, packing under a budget
    augment     crop, flip, RandAugment (Pillow), Mixup / CutMix within a pack
    batch       a planned pack rendered: pixels, kept patches, grid metadata, mixed labels
    objectives  what the encoder learns (a module from a pack to a loss): ``supervised``, ``mae``
    optim       AdamW parameter groups, layer-wise decay, warmup + cosine
    ema         a moving average of the trained weights (``--ema``), swapped in to evaluate and save
    parallel    DDP / FSDP2 and full state dicts (the optimizer's by parameter name)
    checkpoint  atomic resumable state and the same-run check
    build       the run from its config: the encoder (frozen parts, LoRA), the plan, the step count of --epochs
    trainer     the training state of one process, one optimizer step, saving and restoring itself
    evaluation  the objective's sums on a split, validation records, pictures
    log         the per-step JSONL log and the curves PNG
    loop        the run: resume, step count (--minutes calibration), the loop, export, test, probe
"""

# first, before torch loads: the commands' OpenMP wait policy (see moonvit.environment)
import moonvit  # noqa: F401
