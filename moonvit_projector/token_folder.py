"""File names of an exported visual-token folder, shared by the writer and the reader."""

FORMAT = "moonvit-visual-tokens/1"
RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.jsonl"
FAILURES_FILE = "failures.jsonl"
PARTS_DIR = "parts"
PREFIX_TENSOR = "prefix_tokens"
"""A shard's tensor of the prefix tokens of a tower that has them (the classic ViT's CLS row, DeiT's
CLS and distillation rows, DINOv2's CLS and registers): (images in the shard, n_prefix, D), one row
per image encoded into it, the row of an image named by its manifest line's :data:`PREFIX_ROW`.
``run.json`` describes it under its own key (``prefix_tokens``, its ``rows`` naming each); a MoonViT
export, or one of a tower without prefix tokens (SigLIP), has neither."""
PREFIX_ROW = "prefix_row"
"""The manifest key of an image's row in its shard's :data:`PREFIX_TENSOR`."""
POOLED_TENSOR = "pooled"
"""A shard's tensor of each image's pooled vector, for a tower that gives one (the ViT tower's
``pooled``: the CLS row after the final norm, SigLIP's MAP head, a GAP tower's patch mean):
(images in the shard, D), the row of an image named by its manifest line's :data:`POOLED_ROW`.
``run.json`` describes it under its own key (``pooled``, its ``kind`` saying which); a MoonViT
export has neither."""
POOLED_ROW = "pooled_row"
"""The manifest key of an image's row in its shard's :data:`POOLED_TENSOR`."""
PER_IMAGE_ROWS = {PREFIX_TENSOR: PREFIX_ROW, POOLED_TENSOR: POOLED_ROW}
"""The shard tensors holding rows per image (not per token), each with the manifest key of an
image's row in it; an entry of the token cache holds each as (1, ...)."""
