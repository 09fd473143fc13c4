"""File names of an exported visual-token folder, shared by the writer and the reader."""

FORMAT = "moonvit-visual-tokens/1"
RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.jsonl"
FAILURES_FILE = "failures.jsonl"
PARTS_DIR = "parts"
PREFIX_TENSOR = "prefix_tokens"
"""A shard's tensor of the prefix tokens of a tower that has them (the classic ViT's CLS row, DeiT's
CLS and distillation rows): (images in the shard, n_prefix, D), one row per image encoded into it,
the row of an image named by its manifest line's :data:`PREFIX_ROW`. ``run.json`` describes it
under its own key (``prefix_tokens``); a MoonViT export has neither."""
PREFIX_ROW = "prefix_row"
"""The manifest key of an image's row in its shard's :data:`PREFIX_TENSOR`."""
PREFIX_NAMES = ("cls", "distillation")
"""What each prefix row is, in order (``run.json``'s ``prefix_tokens.rows``)."""
