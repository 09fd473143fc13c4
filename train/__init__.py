"""Training MoonViT encoders on packed native-resolution images: ``python -m train``.

Modules, one idea each:
    config      the command line, ``--smoke``, which flags define a run
    data        the dataset's train split cut into training and validation parts, and its test split
    plan        sizes only: random resizing, token dropping, the image stream, packing under a budget
    augment     crop, flip, RandAugment (Pillow), Mixup / CutMix within a pack
    batch       a planned pack rendered: pixels, kept patches, grid metadata, mixed labels
    objectives  what the encoder learns (a module from a pack to a loss): ``supervised``
    optim       AdamW parameter groups, layer-wise decay, warmup + cosine
    parallel    DDP / FSDP2 and full state dicts
    checkpoint  atomic resumable state and the same-run check
    log         the per-step JSONL log and the curves PNG
    loop        the loop, validation, export and the final test
"""
